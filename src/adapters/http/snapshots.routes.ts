import type { FastifyInstance, FastifyRequest } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import type { Pool } from 'pg';
import { z } from 'zod';
import type { ForkMigrate } from '../../commands/migrate/fork-migrate.js';
import { MAX_FORKS } from '../../commands/migrate/fork-live.js';
import {
  assertLayerKey,
  createSnapshotRequestSchema,
  DEFAULT_SNAPSHOT_REQUEST,
  type SnapshotCommands,
} from '../../commands/snapshot/snapshot-commands.js';
import { NotFoundError, ValidationError } from '@fleet/agent-protocol';
import type { ExistingSnapshot } from '../../domain/snapshot/snapshot.decider.js';
import { exportStatusSchema, snapshotModeSchema, snapshotStateSchema } from '../../domain/snapshot/snapshot.events.js';
import type { ProjectionRunner } from '../../projections/runner.js';
import {
  findSnapshotByLayerKey,
  getSnapshot,
  listSnapshots,
  listSnapshotsByDigest,
  type SnapshotRow,
} from '../../projections/snapshots/snapshots.queries.js';
import { positionSchema, problemResponses, waitForPosition } from './common.js';
import { cursorTime, decodeCursor, encodeCursor, pageQuery } from './pagination.js';
import { actorOf, fromState as vmFromState, vmSchema } from './vms.routes.js';

const exportOut = z.object({
  destination: z.string(),
  status: z.string(),
  requested_at: z.string(),
  updated_at: z.string(),
  last_error: z.string().optional(),
});

export const snapshotSchema = z.object({
  id: z.string(),
  tenant_id: z.string(),
  vm_id: z.string(),
  task_id: z.string().nullable(),
  host_id: z.string(),
  arch: z.string(),
  mode: z.string(),
  layer_key: z.string().nullable(),
  digest: z.string().nullable(),
  kind: z.string(),
  state: z.string(),
  size_bytes: z.number(),
  parent_snapshot_id: z.string().nullable(),
  comment: z.string(),
  metadata: z.record(z.string(), z.string()),
  retention_until: z.string().nullable(),
  exports: z.array(exportOut),
  holders: z.array(z.string()),
  last_error: z.string().nullable(),
  created_at: z.string(),
  updated_at: z.string(),
  last_used_at: z.string(),
});
type SnapshotOut = z.infer<typeof snapshotSchema>;
const snapshotCommandResult = snapshotSchema.extend({ position: z.string().nullable() });

/** `POST /v1/vms/:id/fork {count}`: one entry per fork, in order: the VM, or why that fork alone failed. */
const forkManySchema = z.object({
  seed_snapshot_id: z.string(),
  kind: z.string(),
  forks: z.array(
    z.union([z.object({ vm: vmSchema }), z.object({ error: z.object({ code: z.string(), status: z.number(), message: z.string() }) })]),
  ),
});

function fromRow(r: SnapshotRow): SnapshotOut {
  return { ...r, exports: r.exports.map((e) => ({ ...e })) };
}

export function snapshotFromState(s: ExistingSnapshot): SnapshotOut {
  return {
    id: s.snapshot_id,
    tenant_id: s.tenant_id,
    vm_id: s.vm_id,
    task_id: s.task_id ?? null,
    host_id: s.host_id,
    arch: s.arch,
    mode: s.mode,
    layer_key: s.layer_key ?? null,
    digest: s.digest ?? null,
    kind: s.kind,
    state: s.status,
    size_bytes: s.size_bytes,
    parent_snapshot_id: s.parent_snapshot_id ?? null,
    comment: s.comment,
    metadata: { ...s.metadata },
    retention_until: s.retention_until ?? null,
    exports: s.exports.map((e) => ({ ...e })),
    holders: [...s.holders],
    last_error: s.last_error ?? null,
    created_at: s.created_at,
    updated_at: s.updated_at,
    last_used_at: s.last_used_at,
  };
}

export interface SnapshotRoutesDeps {
  readonly snapshots: SnapshotCommands;
  readonly forkMigrate?: ForkMigrate | undefined;
  readonly pool: Pool;
  readonly runner: ProjectionRunner;
  readonly readYourWritesTimeoutMs: number;
}

/** Tenants see only their own snapshots, artifacts and layers: another tenant's is a 404 or a miss. */
export function snapshotRoutes(deps: SnapshotRoutesDeps) {
  // eslint-disable-next-line @typescript-eslint/require-await -- a fastify plugin that returns no promise must call done()
  return async (scope: FastifyInstance): Promise<void> => {
    const app = scope.withTypeProvider<ZodTypeProvider>();
    const params = z.object({ id: z.string().min(1).max(64) });
    const readScope = (req: FastifyRequest): string | undefined => (req.caller.admin ? undefined : req.caller.tenantId);

    app.post(
      '/v1/vms/:id/snapshots',
      {
        schema: {
          tags: ['snapshots'],
          summary: 'Snapshot a running VM (the kind recorded is what the agent produced)',
          params,
          // Lineage is read from the read model: `after` makes it see the caller's previous snapshot.
          querystring: z.object({ after: positionSchema.optional() }),
          body: createSnapshotRequestSchema.optional(),
          response: { 201: snapshotCommandResult, ...problemResponses },
        },
      },
      async (req, reply) => {
        await waitForPosition(deps.runner, req.query.after, deps.readYourWritesTimeoutMs);
        const r = await deps.snapshots.create(req.params.id, req.body ?? DEFAULT_SNAPSHOT_REQUEST, actorOf(req));
        return reply.status(201).send({ ...snapshotFromState(r.snapshot), position: r.position ?? null });
      },
    );

    app.get(
      '/v1/snapshots',
      {
        schema: {
          tags: ['snapshots'],
          summary: 'List snapshots (newest first)',
          querystring: z.object({
            ...pageQuery,
            vm_id: z.string().max(64).optional(),
            task_id: z.string().max(200).optional(),
            tenant_id: z.string().max(64).optional(),
            state: snapshotStateSchema.optional(),
            mode: snapshotModeSchema.optional(),
            layer_key: z.string().max(200).optional(),
            arch: z.string().max(32).optional(),
            name: z.string().max(256).optional(),
            after: positionSchema.optional(),
          }),
          response: { 200: z.object({ snapshots: z.array(snapshotSchema), next_cursor: z.string().nullable() }), ...problemResponses },
        },
      },
      async (req) => {
        await waitForPosition(deps.runner, req.query.after, deps.readYourWritesTimeoutMs);
        const q = req.query;
        // A tenant's scope comes from its key; a tenant_id filter narrows an admin's view only.
        const tenantId = readScope(req) ?? q.tenant_id;
        const after = decodeCursor(q.cursor, z.object({ created_at: cursorTime, id: z.string() }));
        const rows = await listSnapshots(deps.pool, {
          tenantId,
          vmId: q.vm_id,
          taskId: q.task_id,
          state: q.state,
          mode: q.mode,
          layerKey: q.layer_key,
          arch: q.arch,
          name: q.name,
          limit: q.limit,
          after,
        });
        const last = rows.at(-1);
        return {
          snapshots: rows.map(fromRow),
          next_cursor: rows.length === q.limit && last ? encodeCursor({ created_at: last.created_at, id: last.id }) : null,
        };
      },
    );

    app.get(
      '/v1/snapshots/:id',
      {
        schema: {
          tags: ['snapshots'],
          summary: 'Get a snapshot',
          params,
          querystring: z.object({ after: positionSchema.optional() }),
          response: { 200: snapshotSchema, ...problemResponses },
        },
      },
      async (req) => {
        await waitForPosition(deps.runner, req.query.after, deps.readYourWritesTimeoutMs);
        const row = await getSnapshot(deps.pool, req.params.id, readScope(req));
        if (!row) throw new NotFoundError('SNAPSHOT_NOT_FOUND', `snapshot ${req.params.id} does not exist`, { snapshot_id: req.params.id });
        return fromRow(row);
      },
    );

    app.delete(
      '/v1/snapshots/:id',
      {
        schema: {
          tags: ['snapshots'],
          summary: 'Delete a snapshot (refused while a later snapshot depends on it, unless force=true)',
          params,
          querystring: z.object({ force: z.enum(['true', 'false']).optional() }),
          response: { 200: snapshotCommandResult, ...problemResponses },
        },
      },
      async (req) => {
        const r = await deps.snapshots.delete(req.params.id, actorOf(req), { force: req.query.force === 'true' });
        return { ...snapshotFromState(r.snapshot), position: r.position ?? null };
      },
    );

    app.post(
      '/v1/snapshots/:id/exports',
      {
        schema: {
          tags: ['snapshots'],
          summary: 'Record an export intent',
          params,
          body: z.object({ destination: z.string().min(1).max(2048) }),
          response: { 201: snapshotCommandResult, ...problemResponses },
        },
      },
      async (req, reply) => {
        const r = await deps.snapshots.requestExport(req.params.id, req.body.destination, actorOf(req));
        return reply.status(201).send({ ...snapshotFromState(r.snapshot), position: r.position ?? null });
      },
    );

    app.patch(
      '/v1/snapshots/:id/exports',
      {
        schema: {
          tags: ['snapshots'],
          summary: "Record an export's status (the exporter reports progress)",
          params,
          body: z.object({ destination: z.string().min(1).max(2048), status: exportStatusSchema, error: z.string().max(4096).optional() }),
          response: { 200: snapshotCommandResult, ...problemResponses },
        },
      },
      async (req) => {
        const r = await deps.snapshots.updateExport(req.params.id, req.body.destination, req.body.status, req.body.error, actorOf(req));
        return { ...snapshotFromState(r.snapshot), position: r.position ?? null };
      },
    );

    app.get(
      '/v1/artifacts/:digest',
      {
        schema: {
          tags: ['snapshots'],
          summary: "The artifact index: the caller's ready snapshots with this digest, and the hosts holding them",
          params: z.object({ digest: z.string().max(128) }),
          querystring: z.object({ after: positionSchema.optional() }),
          response: {
            200: z.object({ digest: z.string(), snapshots: z.array(snapshotSchema), hosts: z.array(z.string()) }),
            ...problemResponses,
          },
        },
      },
      async (req) => {
        if (!/^[0-9a-f]{64}$/.test(req.params.digest))
          throw new ValidationError(
            'digest must be a lowercase hex sha256',
            [{ path: 'params.digest', message: 'not a sha256' }],
            'INVALID_DIGEST',
          );
        await waitForPosition(deps.runner, req.query.after, deps.readYourWritesTimeoutMs);
        // Always the caller's own tenant, admin included: the index never answers across tenants.
        const rows = await listSnapshotsByDigest(deps.pool, req.caller.tenantId, req.params.digest);
        return { digest: req.params.digest, snapshots: rows.map(fromRow), hosts: [...new Set(rows.flatMap((r) => r.holders))].sort() };
      },
    );

    app.get(
      '/v1/layers/:key',
      {
        schema: {
          tags: ['snapshots'],
          summary: "The layer cache: the caller's newest ready layer artifact for this key and arch",
          params: z.object({ key: z.string().max(256) }),
          querystring: z.object({ arch: z.string().min(1).max(32), after: positionSchema.optional() }),
          response: { 200: snapshotSchema, ...problemResponses },
        },
      },
      async (req) => {
        assertLayerKey(req.params.key);
        await waitForPosition(deps.runner, req.query.after, deps.readYourWritesTimeoutMs);
        const row = await findSnapshotByLayerKey(deps.pool, req.caller.tenantId, req.params.key, req.query.arch);
        if (!row)
          throw new NotFoundError('LAYER_NOT_FOUND', `no ready layer for key ${req.params.key} on ${req.query.arch}`, {
            layer_key: req.params.key,
            arch: req.query.arch,
          });
        // A hit is use: idle collection must not take a layer builds keep hitting.
        await deps.snapshots.recordUse(row.id, actorOf(req));
        return fromRow(row);
      },
    );

    app.get(
      '/v1/snapshot-quota',
      {
        schema: {
          tags: ['snapshots'],
          summary: "The caller's snapshot quota usage (from its tenant stream)",
          response: {
            200: z.object({
              tenant_id: z.string(),
              count: z.number(),
              bytes: z.number(),
              max_count: z.number(),
              max_bytes: z.number(),
              /** Build (mode "build") snapshots: their own pool (BUILD_SNAPSHOT_QUOTA_*). */
              builds: z.object({ count: z.number(), bytes: z.number(), max_count: z.number(), max_bytes: z.number() }),
            }),
            ...problemResponses,
          },
        },
      },
      async (req) => ({ tenant_id: req.caller.tenantId, ...(await deps.snapshots.quotaUsage(req.caller.tenantId)) }),
    );

    const fm = deps.forkMigrate;
    if (fm) {
      app.post(
        '/v1/vms/:id/fork',
        {
          schema: {
            tags: ['vms'],
            summary:
              'Fork a VM: snapshot it (or reuse a ready snapshot) and create a new VM from it with fresh credentials. With count (1-100): one capture (live where the host has CRIU: the forks continue its processes) restored count times; one result per fork (201 all made, 207 otherwise)',
            params,
            body: z
              .object({
                comment: z.string().max(1024).optional(),
                reuse_snapshot_id: z.string().max(64).optional(),
                count: z.number().int().min(1).max(MAX_FORKS).optional(),
              })
              .strict()
              .optional(),
            response: {
              201: z.union([vmSchema.extend({ position: z.string().nullable(), seed_snapshot_id: z.string() }), forkManySchema]),
              207: forkManySchema,
              ...problemResponses,
            },
          },
        },
        async (req, reply) => {
          const count = req.body?.count;
          if (count !== undefined) {
            const many = await fm.forkMany(req.params.id, { ...req.body, count }, actorOf(req));
            const forks = many.forks.map((f) => (f.ok ? { vm: vmFromState(f.vm) } : { error: f.error }));
            return reply
              .status(many.forks.every((f) => f.ok) ? 201 : 207)
              .send({ seed_snapshot_id: many.snapshotId, kind: many.kind, forks });
          }
          const r = await fm.fork(req.params.id, req.body ?? {}, actorOf(req));
          return reply.status(201).send({ ...vmFromState(r.vm), position: r.position ?? null, seed_snapshot_id: r.snapshotId });
        },
      );

      app.post(
        '/v1/vms/:id/migrate',
        {
          schema: {
            tags: ['vms'],
            summary:
              'Migrate a VM to another host (it keeps its id): cold, or live (processes survive; hosts with CRIU) with the downtime in the answer; live is refused before anything freezes when no target can restore it',
            params,
            body: z
              .object({
                target_host_id: z.string().max(64).optional(),
                live: z.boolean().default(false),
                lazy: z.boolean().default(false),
                keep_paused: z.boolean().default(false),
              })
              .strict()
              .optional(),
            response: {
              200: vmSchema.extend({
                position: z.string().nullable(),
                from_host_id: z.string(),
                snapshot_id: z.string(),
                downtime_ms: z.number().optional(),
                readdressed: z.boolean().optional(),
              }),
              ...problemResponses,
            },
          },
        },
        async (req) => {
          const r = await fm.migrate(req.params.id, req.body ?? { live: false, lazy: false, keep_paused: false }, actorOf(req));
          return {
            ...vmFromState(r.vm),
            position: r.position ?? null,
            from_host_id: r.fromHostId,
            snapshot_id: r.snapshotId,
            ...(r.live ? { downtime_ms: r.live.downtimeMs, readdressed: r.live.readdressed } : {}),
          };
        },
      );
    }
  };
}
