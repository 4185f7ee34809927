import { randomBytes } from 'node:crypto';
import { SnapshotGc } from '../gc/snapshot-gc.js';
import { bindAggregate, type BoundOf, type Loaded } from '../command-handler.js';
import { tenantAggregate } from '../../domain/tenant/tenant.aggregate.js';
import { snapshotAggregate } from '../../domain/snapshot/snapshot.aggregate.js';
import type { Logger } from 'pino';
import { z } from 'zod';
import { AppError, ConflictError, NotFoundError, ValidationError } from '@fleet/agent-protocol';
import type { Position } from '../../domain/event-store.port.js';
import { classifyHostAgentError } from '../../domain/host-agent.port.js';
import { idSchema } from '../../domain/ids.js';
import { type ExistingSnapshot, type SnapshotAggregate, type SnapshotCommand } from '../../domain/snapshot/snapshot.decider.js';
import { layerKeySchema, snapshotModeSchema, type SnapshotDeleteReason } from '../../domain/snapshot/snapshot.events.js';
import {
  QuotaExceededError,
  quotaUsage,
  type QuotaLimits,
  type QuotaPool,
  type TenantCommand,
} from '../../domain/tenant/tenant.decider.js';
import { validationErrorFromZod } from '../../domain/vm/spec.js';
import { CommandHandler, type CommandMeta } from '../command-handler.js';
import type { HostCommands } from '../host/host-commands.js';
import { sandboxName, type Actor, type SeedArtifacts, type VmCommands } from '../vm/vm-commands.js';
import { KeyedQueue } from '../keyed-queue.js';

/** Metadata keys the service writes itself; a caller may not set them. */
export const RESERVED_METADATA_KEYS = ['comment', 'vm_id', 'mode', 'host_id', 'arch', 'layer_key', 'tenant_id', 'kind'] as const;

const RETENTION_MIN = Date.parse('0001-01-01T00:00:00Z');
const RETENTION_MAX = Date.parse('9999-12-31T23:59:59Z');
const RETENTION_MAX_S = 100 * 366 * 24 * 3600;

export const createSnapshotRequestSchema = z
  .object({
    mode: snapshotModeSchema.default('manual'),
    comment: z.string().max(1024).default(''),
    metadata: z
      .record(z.string().regex(/^[A-Za-z0-9_.-]{1,64}$/, 'a metadata key of 1-64 letters, digits, _ . -'), z.string().max(4096))
      .default({}),
    /** Absolute expiry; or retention_s from now; neither: the fleet default. */
    // Bounded to what a Postgres timestamptz and the event schema both take: one outside (year 0000, say) would be
    // recorded and then stop the snapshots read model at that event.
    retention_until: z.iso
      .datetime({ offset: true })
      .refine((v) => Date.parse(v) >= RETENTION_MIN && Date.parse(v) <= RETENTION_MAX, 'a time between 0001-01-01 and 9999-12-31 (UTC)')
      .optional(),
    retention_s: z.number().int().positive().max(RETENTION_MAX_S, 'at most 100 years').optional(),
    no_lineage: z.boolean().default(false),
    live: z.boolean().default(false),
    diff: z.boolean().default(false),
    keep_paused: z.boolean().default(false),
    shrink: z.boolean().default(false),
    layer_key: layerKeySchema.optional(),
    exports: z
      .array(z.object({ destination: z.string().min(1).max(2048) }))
      .max(16)
      .default([]),
  })
  .strict()
  .superRefine((r, ctx) => {
    for (const k of Object.keys(r.metadata)) {
      if ((RESERVED_METADATA_KEYS as readonly string[]).includes(k))
        ctx.addIssue({ code: 'custom', path: ['metadata', k], message: `"${k}" is reserved: the service sets it` });
    }
    if (r.retention_until !== undefined && r.retention_s !== undefined)
      ctx.addIssue({ code: 'custom', path: ['retention_s'], message: 'give retention_until or retention_s, not both' });
    if (r.diff && !r.live) ctx.addIssue({ code: 'custom', path: ['diff'], message: 'a diff snapshot needs live: true' });
    if (r.keep_paused && !r.diff)
      ctx.addIssue({ code: 'custom', path: ['keep_paused'], message: 'keep_paused applies to a diff snapshot only' });
    if (r.layer_key !== undefined && r.mode !== 'build')
      ctx.addIssue({ code: 'custom', path: ['layer_key'], message: 'a layer is a build artifact: set mode "build" with layer_key' });
  });
export type CreateSnapshotRequest = z.input<typeof createSnapshotRequestSchema>;

/** Read-model queries the snapshot commands use for candidate selection (they may lag; the streams decide). */
export interface SnapshotReads {
  latestReadyOfVm(vmId: string): Promise<{ id: string } | undefined>;
  dependentsOf(snapshotId: string): Promise<string[]>;
  expired(now: Date): Promise<Array<{ id: string; tenant_id: string }>>;
  idleLayers(before: Date): Promise<Array<{ id: string; tenant_id: string }>>;
  layersOverCap(max: number): Promise<Array<{ id: string; tenant_id: string }>>;
  /** VMs not yet ended whose spec seeds from this snapshot. */
  liveVmsSeededFrom(snapshotId: string): Promise<string[]>;
  /** Deleted snapshots some host still holds (a delete the agent did not finish). */
  deletedWithHolders(): Promise<Array<{ id: string; tenant_id: string }>>;
}

export interface SnapshotConfig {
  readonly defaultRetentionMs: number;
  readonly quota: QuotaLimits;
  /** Build (mode "build") snapshots per tenant: a pool of their own, outside `quota`. */
  readonly buildQuota: QuotaLimits;
  /** 0: the agent client's default. */
  readonly pullTimeoutMs: number;
  readonly checkpointTimeoutMs: number;
  readonly idleTtlMs: number;
  readonly maxPerTenant: number;
  readonly gcIntervalMs: number;
}

export interface SnapshotResult {
  readonly snapshot: ExistingSnapshot;
  readonly position: Position | undefined;
}

/**
 * Snapshots of running VMs (`snapshot-<id>`), the per-tenant quota
 * (`tenant-<id>`), artifact moves between hosts, and their collection.
 */
export class SnapshotCommands implements SeedArtifacts {
  private readonly tenantQueues = new KeyedQueue();
  /** Quota reservations retry many times: losing a race to a sibling is the normal case, not an error. */
  private readonly quotaHandler: CommandHandler;
  private readonly gc: SnapshotGc;

  private readonly quotaTenantHandler: BoundOf<typeof tenantAggregate>;
  private readonly snapshotHandler: BoundOf<typeof snapshotAggregate>;

  constructor(
    private readonly handler: CommandHandler,
    private readonly hosts: HostCommands,
    private readonly vms: VmCommands,
    private readonly reads: SnapshotReads,
    private readonly config: SnapshotConfig,
    private readonly logger: Logger,
    quotaHandler?: CommandHandler,
  ) {
    this.quotaHandler = quotaHandler ?? handler;
    this.gc = new SnapshotGc(this, reads, config, logger);
    this.quotaTenantHandler = bindAggregate(this.quotaHandler, tenantAggregate);
    this.snapshotHandler = bindAggregate(handler, snapshotAggregate);
  }

  // ---------------------------------------------------------------- create

  async create(vmId: string, input: unknown, actor: Actor, now = new Date()): Promise<SnapshotResult> {
    const parsed = createSnapshotRequestSchema.safeParse(input ?? {});
    if (!parsed.success) throw validationErrorFromZod(parsed.error, 'snapshot request');
    const req = parsed.data;
    const vm = await this.vms.get(vmId, actor);
    if (vm.status !== 'running' || !vm.host_id) {
      throw new AppError('VM_NOT_RUNNING', 409, `vm ${vmId} is ${vm.status}: only a running VM can be snapshotted`, {
        vm_id: vmId,
        status: vm.status,
      });
    }
    const hostId = vm.host_id;
    const { state: host } = await this.hosts.load(hostId);
    const arch = host.status === 'unregistered' ? '' : (host.capacity.arch ?? '');
    const snapshotId = `snap-${randomBytes(10).toString('hex')}`;
    // A layer is filed under the caller's tenant (from its key) so a later build of the same tenant can hit;
    // every other snapshot belongs to its VM's tenant.
    const tenantId = req.layer_key !== undefined ? actor.tenantId : vm.tenant_id;
    const counted = req.mode !== 'build';
    const retentionUntil =
      req.retention_until ??
      (req.retention_s !== undefined
        ? new Date(now.getTime() + req.retention_s * 1000).toISOString()
        : this.config.defaultRetentionMs > 0
          ? new Date(now.getTime() + this.config.defaultRetentionMs).toISOString()
          : undefined);
    // A layer is found by its key, not by a VM's history: it takes no lineage link (which would pin its predecessor).
    const parent = req.no_lineage || req.layer_key !== undefined ? undefined : (await this.reads.latestReadyOfVm(vmId))?.id;
    const metadata: Record<string, string> = { ...req.metadata, comment: req.comment, vm_id: vmId, mode: req.mode, host_id: hostId, arch };
    if (req.layer_key !== undefined) metadata.layer_key = req.layer_key;

    const pool: QuotaPool = counted ? 'snapshots' : 'builds';
    const limits = counted ? this.config.quota : this.config.buildQuota;
    const name = sandboxName(vmId);
    // Bytes are checked BEFORE anything is archived: the agent tells what a checkpoint of the layer is expected to take.
    const expected = limits.max_bytes > 0 ? (await (await this.hosts.agentFor(hostId)).layerUsage(name)).expected_archive_bytes : 0;
    const maxBytes = await this.reserveQuota(tenantId, snapshotId, actor, pool, limits, expected);
    try {
      await this.run(
        snapshotId,
        {
          type: 'RequestSnapshot',
          data: {
            snapshot_id: snapshotId,
            vm_id: vmId,
            tenant_id: tenantId,
            task_id: vm.task_id,
            host_id: hostId,
            arch,
            mode: req.mode,
            comment: req.comment,
            metadata,
            retention_until: retentionUntil,
            parent_snapshot_id: parent,
            layer_key: req.layer_key,
            ask: { live: req.live, diff: req.diff, keep_paused: req.keep_paused, shrink: req.shrink },
            quota_counted: counted,
          },
        },
        actor,
      );
    } catch (err) {
      await this.releaseQuota(tenantId, snapshotId, actor);
      throw err;
    }
    let archived = false;
    try {
      const agent = await this.hosts.agentFor(hostId);
      // The protocol carries `live` only; diff/keep_paused/shrink are recorded as asked, and the kind is what came back.
      // max_bytes: the agent abandons an archive that outgrows the quota's headroom (the guest wrote on after the estimate).
      const cp = await agent.checkpoint(
        name,
        { id: snapshotId, comment: req.comment, live: req.live, ...(maxBytes ? { max_bytes: maxBytes } : {}) },
        { timeoutMs: this.config.checkpointTimeoutMs },
      );
      archived = true;
      // The real size replaces the estimate, and is refused if siblings took the room meanwhile: never over quota.
      await this.onTenant(tenantId, () =>
        this.quotaTenantHandler.handle(
          tenantId,
          {
            type: 'SizeSnapshotQuota',
            data: { tenant_id: tenantId, snapshot_id: snapshotId, size_bytes: cp.size_bytes, limits },
          } satisfies TenantCommand,
          actor,
        ),
      );
      const done = await this.run(
        snapshotId,
        {
          type: 'CompleteSnapshot',
          data: { snapshot_id: snapshotId, digest: cp.digest, size_bytes: cp.size_bytes, kind: cp.kind, files: cp.files },
        },
        actor,
      );
      let last = done;
      for (const e of req.exports)
        last = await this.run(snapshotId, { type: 'RequestExport', data: { snapshot_id: snapshotId, destination: e.destination } }, actor);
      return last;
    } catch (err) {
      const e = err instanceof AppError ? err : undefined;
      this.logger.warn(
        { snapshot_id: snapshotId, vm_id: vmId, code: e?.code, err: { message: (err as Error).message } },
        'snapshot failed',
      );
      await this.run(
        snapshotId,
        { type: 'FailSnapshot', data: { snapshot_id: snapshotId, error: (err as Error).message, error_code: e?.code } },
        actor,
      ).catch(() => undefined);
      await this.releaseQuota(tenantId, snapshotId, actor).catch(() => undefined);
      if (archived) {
        const agent = await this.hosts.agentFor(hostId).catch(() => undefined);
        await agent
          ?.deleteCheckpoint(snapshotId)
          .catch((de: unknown) =>
            this.logger.warn(
              { snapshot_id: snapshotId, err: { message: (de as Error).message } },
              'refused archive not deleted on its host',
            ),
          );
      }
      if (e?.code === 'CHECKPOINT_TOO_LARGE') {
        const { state } = await this.quotaTenantHandler.load(tenantId);
        throw new QuotaExceededError(tenantId, 'bytes', limits, quotaUsage(state, pool), { pool });
      }
      throw err;
    }
  }

  // ---------------------------------------------------------------- read, delete, export

  /** The snapshot as its stream says, for this caller: another tenant's snapshot does not exist (404). */
  async get(snapshotId: string, actor: Pick<Actor, 'tenantId' | 'admin'>): Promise<ExistingSnapshot> {
    if (!idSchema.safeParse(snapshotId).success) throw new NotFoundError('SNAPSHOT_NOT_FOUND', `snapshot ${snapshotId} does not exist`);
    const { state } = await this.snapshotHandler.load(snapshotId);
    if (state.status === 'initial' || (!actor.admin && state.tenant_id !== actor.tenantId))
      throw new NotFoundError('SNAPSHOT_NOT_FOUND', `snapshot ${snapshotId} does not exist`, { snapshot_id: snapshotId });
    return state;
  }

  /**
   * Refused while a live snapshot's lineage names this one, unless forced.
   * The event comes first, then the agents' deletes: a delete the agent did
   * not finish leaves a holder that the collector retries.
   */
  async delete(snapshotId: string, actor: Actor, opts: { force?: boolean; reason?: SnapshotDeleteReason } = {}): Promise<SnapshotResult> {
    const s = await this.get(snapshotId, actor);
    if (s.status === 'deleted') return { snapshot: s, position: undefined };
    if (!opts.force) {
      const deps = await this.reads.dependentsOf(snapshotId);
      if (deps.length > 0) {
        throw new ConflictError(
          'SNAPSHOT_HAS_DEPENDENTS',
          `snapshot ${snapshotId} is the lineage parent of ${deps.join(', ')}: delete those first, or pass force=true`,
          { snapshot_id: snapshotId, dependents: deps },
        );
      }
    }
    const r = await this.run(
      snapshotId,
      { type: 'DeleteSnapshot', data: { snapshot_id: snapshotId, reason: opts.reason ?? 'client', forced: opts.force ?? false } },
      actor,
    );
    if (s.quota_counted || s.mode === 'build') await this.releaseQuota(s.tenant_id, snapshotId, actor);
    const dropped = await this.dropCopies(r.snapshot, actor);
    return dropped ?? r;
  }

  async requestExport(snapshotId: string, destination: string, actor: Actor): Promise<SnapshotResult> {
    await this.get(snapshotId, actor);
    return this.run(snapshotId, { type: 'RequestExport', data: { snapshot_id: snapshotId, destination } }, actor);
  }

  async updateExport(
    snapshotId: string,
    destination: string,
    status: 'pending' | 'running' | 'done' | 'failed',
    error: string | undefined,
    actor: Actor,
  ): Promise<SnapshotResult> {
    await this.get(snapshotId, actor);
    return this.run(snapshotId, { type: 'UpdateExport', data: { snapshot_id: snapshotId, destination, status, error } }, actor);
  }

  /** A layer-cache hit counts as use (idle collection reads it). */
  async recordUse(snapshotId: string, meta: CommandMeta): Promise<void> {
    await this.run(snapshotId, { type: 'RecordUse', data: { snapshot_id: snapshotId } }, meta).catch((err: unknown) =>
      this.logger.debug({ snapshot_id: snapshotId, err: { message: (err as Error).message } }, 'use not recorded'),
    );
  }

  /** Deletes a deleted snapshot's artifact from every host still holding it. */
  async dropCopies(s: ExistingSnapshot, meta: CommandMeta): Promise<SnapshotResult | undefined> {
    let last: SnapshotResult | undefined;
    for (const hostId of s.holders) {
      try {
        const agent = await this.hosts.agentFor(hostId);
        await agent.deleteCheckpoint(s.snapshot_id);
        last = await this.run(s.snapshot_id, { type: 'DropArtifact', data: { snapshot_id: s.snapshot_id, host_id: hostId } }, meta);
      } catch (err) {
        this.logger.warn(
          { snapshot_id: s.snapshot_id, host_id: hostId, err: { message: (err as Error).message } },
          'artifact not deleted on its host; the collector retries',
        );
      }
    }
    return last;
  }

  // ---------------------------------------------------------------- seeds and moves

  async holders(snapshotId: string, actor: Actor): Promise<ReadonlySet<string>> {
    const s = await this.get(snapshotId, actor);
    if (s.status !== 'ready')
      throw new ConflictError('SNAPSHOT_NOT_READY', `snapshot ${snapshotId} is ${s.status}: only a ready snapshot can seed a VM`, {
        snapshot_id: snapshotId,
        state: s.status,
      });
    if (s.holders.length === 0)
      throw new ConflictError('SNAPSHOT_NOT_HELD', `no host holds snapshot ${snapshotId} any more`, { snapshot_id: snapshotId });
    return new Set(s.holders);
  }

  /**
   * Gives `hostId` a copy: a grant on a holder, a pull on the target (the
   * target verifies the sha256 and commits atomically), bounded by
   * ARTIFACT_PULL_TIMEOUT; then the move is an event and the target a holder.
   */
  async ensureOn(snapshotId: string, hostId: string, actor: Actor): Promise<void> {
    const s = await this.get(snapshotId, actor);
    if (s.status !== 'ready')
      throw new ConflictError('SNAPSHOT_NOT_READY', `snapshot ${snapshotId} is ${s.status}`, { snapshot_id: snapshotId, state: s.status });
    if (s.holders.includes(hostId)) {
      await this.recordUse(snapshotId, actor);
      return;
    }
    await this.move(s, hostId, actor);
  }

  async move(s: ExistingSnapshot, toHostId: string, meta: CommandMeta): Promise<void> {
    const fromHostId = s.holders[0];
    if (!fromHostId)
      throw new ConflictError('SNAPSHOT_NOT_HELD', `no host holds snapshot ${s.snapshot_id}`, { snapshot_id: s.snapshot_id });
    if (!s.digest || !/^[0-9a-f]{64}$/.test(s.digest)) {
      throw new ConflictError(
        'ARTIFACT_DIGEST_UNKNOWN',
        `snapshot ${s.snapshot_id} has no recorded digest, so a copy could not be verified: it stays on ${fromHostId}`,
        { snapshot_id: s.snapshot_id },
      );
    }
    const started = Date.now();
    try {
      const { state: from } = await this.hosts.load(fromHostId);
      if (from.status === 'unregistered') throw new NotFoundError('HOST_NOT_FOUND', `host ${fromHostId} is not registered`);
      const src = this.hosts.agentForState(from);
      const dst = await this.hosts.agentFor(toHostId);
      const timeoutMs = this.config.pullTimeoutMs > 0 ? this.config.pullTimeoutMs : undefined;
      const ttl = Math.max(60, Math.ceil((timeoutMs ?? 300_000) / 1000) + 30);
      const grant = await src.grantArtifact(s.snapshot_id, Math.min(3600, ttl));
      const moved = await dst.pullArtifact(
        {
          snapshot_id: s.snapshot_id,
          digest: s.digest,
          from: { url: from.url, grant: grant.grant, host_id: fromHostId },
          files: { ...s.files },
        },
        timeoutMs !== undefined ? { timeoutMs } : {},
      );
      await this.run(
        s.snapshot_id,
        {
          type: 'RecordArtifactMoved',
          data: {
            snapshot_id: s.snapshot_id,
            from_host_id: fromHostId,
            to_host_id: toHostId,
            size_bytes: moved.size_bytes,
            kind: moved.kind,
            duration_ms: Date.now() - started,
          },
        },
        meta,
      );
    } catch (err) {
      const e = err instanceof AppError ? err : undefined;
      await this.run(
        s.snapshot_id,
        {
          type: 'RecordArtifactMoveFailed',
          data: {
            snapshot_id: s.snapshot_id,
            from_host_id: fromHostId,
            to_host_id: toHostId,
            error: (err as Error).message,
            error_code: e?.code,
          },
        },
        meta,
      ).catch(() => undefined);
      const timedOut = e?.code === 'HOST_UNREACHABLE' && typeof e.details?.timeout_ms === 'number';
      throw new AppError(
        timedOut ? 'ARTIFACT_PULL_TIMEOUT' : 'ARTIFACT_MOVE_FAILED',
        timedOut ? 504 : classifyHostAgentError(err) === 'host' ? 502 : (e?.status ?? 502),
        `moving snapshot ${s.snapshot_id} from ${fromHostId} to ${toHostId} failed${timedOut ? ` (ARTIFACT_PULL_TIMEOUT_MS=${this.config.pullTimeoutMs})` : ''}: ${(err as Error).message}`,
        { snapshot_id: s.snapshot_id, from_host_id: fromHostId, to_host_id: toHostId, cause_code: e?.code },
        { cause: err },
      );
    }
  }

  // ---------------------------------------------------------------- quota

  /** Reserves `expected` bytes in `pool`; returns the headroom the archive may use (max_bytes less the others), undefined without a byte limit. */
  private async reserveQuota(
    tenantId: string,
    snapshotId: string,
    meta: CommandMeta,
    pool: QuotaPool,
    limits: QuotaLimits,
    expected: number,
  ): Promise<number | undefined> {
    const r = await this.onTenant(tenantId, () =>
      this.quotaTenantHandler.handle(
        tenantId,
        {
          type: 'ReserveSnapshotQuota',
          data: { tenant_id: tenantId, snapshot_id: snapshotId, limits, pool, expected_bytes: expected },
        } satisfies TenantCommand,
        meta,
      ),
    );
    if (limits.max_bytes <= 0) return undefined;
    const others = quotaUsage(r.state, pool).bytes - (r.state.reservations.get(snapshotId) ?? r.state.builds.get(snapshotId) ?? 0);
    return Math.max(1, limits.max_bytes - others);
  }

  private async releaseQuota(tenantId: string, snapshotId: string, meta: CommandMeta): Promise<void> {
    await this.onTenant(tenantId, () =>
      this.quotaTenantHandler.handle(
        tenantId,
        { type: 'ReleaseSnapshotQuota', data: { tenant_id: tenantId, snapshot_id: snapshotId } } satisfies TenantCommand,
        meta,
      ),
    );
  }

  async quotaUsage(tenantId: string): Promise<{
    count: number;
    bytes: number;
    max_count: number;
    max_bytes: number;
    builds: { count: number; bytes: number; max_count: number; max_bytes: number };
  }> {
    const { state } = await this.quotaTenantHandler.load(tenantId);
    return {
      ...quotaUsage(state, 'snapshots'),
      ...this.config.quota,
      builds: { ...quotaUsage(state, 'builds'), ...this.config.buildQuota },
    };
  }

  /** Writers of one tenant stream in this process go one at a time; other processes lose a revision conflict and retry. */
  private onTenant<T>(tenantId: string, fn: () => Promise<T>): Promise<T> {
    return this.tenantQueues.run(tenantId, fn);
  }

  // ---------------------------------------------------------------- collection

  start(): void {
    this.gc.start();
  }

  async stop(): Promise<void> {
    await this.gc.stop();
  }

  /** One collection pass (see SnapshotGc). */
  async collect(now = new Date()): Promise<{ expired: number; idle: number; evicted: number; retried: number }> {
    return this.gc.collect(now);
  }

  async load(snapshotId: string): Promise<Loaded<SnapshotAggregate>> {
    return this.snapshotHandler.load(snapshotId);
  }

  private async run(snapshotId: string, command: SnapshotCommand, meta: CommandMeta): Promise<SnapshotResult> {
    const r = await this.snapshotHandler.handle(snapshotId, command, meta);
    if (r.state.status === 'initial') throw new AppError('INTERNAL', 500, `snapshot ${snapshotId} has no state after ${command.type}`);
    return { snapshot: r.state, position: r.position };
  }
}

export function assertLayerKey(key: string): void {
  if (!layerKeySchema.safeParse(key).success)
    throw new ValidationError(
      `layer key ${JSON.stringify(key.slice(0, 80))} is invalid: use 1-200 letters, digits, ".", "_", ":" or "-"`,
      [{ path: 'params.key', message: 'invalid layer key' }],
      'INVALID_LAYER_KEY',
    );
}
