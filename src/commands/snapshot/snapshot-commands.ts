import type { Logger } from 'pino';
import { ConflictError, NotFoundError } from '@fleet/agent-protocol';
import { idSchema } from '../../domain/ids.js';
import type { ExistingSnapshot, SnapshotAggregate } from '../../domain/snapshot/snapshot.decider.js';
import type { SnapshotDeleteReason } from '../../domain/snapshot/snapshot.events.js';
import type { CommandHandler, CommandMeta, Loaded } from '../command-handler.js';
import { SnapshotGc } from '../gc/snapshot-gc.js';
import { KeyedQueue } from '../keyed-queue.js';
import type { HostCommands } from '../host/host-commands.js';
import type { Actor, SeedArtifacts, VmCommands } from '../vm/vm-commands.js';
import { ArtifactMoves } from './artifact-moves.js';
import { SnapshotCreate } from './snapshot-create.js';
import { SnapshotQuota } from './snapshot-quota.js';
import { SnapshotStream } from './snapshot-stream.js';
import type { SnapshotConfig, SnapshotReads, SnapshotResult } from './snapshot-types.js';
import type { SnapshotRequest } from './snapshot-request.js';
export {
  assertLayerKey,
  createSnapshotRequestSchema,
  DEFAULT_SNAPSHOT_REQUEST,
  RESERVED_METADATA_KEYS,
  snapshotRequest,
  type CreateSnapshotRequest,
  type SnapshotRequest,
} from './snapshot-request.js';
export type { SnapshotConfig, SnapshotReads, SnapshotResult } from './snapshot-types.js';

/**
 * Snapshots of running VMs (`snapshot-<id>`), the per-tenant quota
 * (`tenant-<id>`), artifact moves between hosts, and their collection.
 */
export class SnapshotCommands implements SeedArtifacts {
  private readonly gc: SnapshotGc;
  private readonly stream: SnapshotStream;
  private readonly quota: SnapshotQuota;
  private readonly creator: SnapshotCreate;
  private readonly moves: ArtifactMoves;
  /** Forks placed together on one host wait for one copy of their seed instead of pulling it twice. */
  private readonly copies = new KeyedQueue();

  constructor(
    handler: CommandHandler,
    private readonly hosts: HostCommands,
    vms: VmCommands,
    private readonly reads: SnapshotReads,
    private readonly config: SnapshotConfig,
    private readonly logger: Logger,
    quotaHandler?: CommandHandler,
  ) {
    this.stream = new SnapshotStream(handler);
    this.quota = new SnapshotQuota(quotaHandler ?? handler, config);
    this.creator = new SnapshotCreate(this.stream, this.quota, hosts, vms, reads, config, logger);
    this.moves = new ArtifactMoves(this.stream, hosts, config);
    this.gc = new SnapshotGc(this, reads, config, logger);
  }

  // ---------------------------------------------------------------- create

  /** A snapshot of a running VM (snapshot-create.ts). */
  create(vmId: string, req: SnapshotRequest, actor: Actor, now = new Date()): Promise<SnapshotResult> {
    return this.creator.create(vmId, req, actor, now);
  }

  // ---------------------------------------------------------------- read, delete, export

  /** The snapshot as its stream says, for this caller: another tenant's snapshot does not exist (404). */
  async get(snapshotId: string, actor: Pick<Actor, 'tenantId' | 'admin'>): Promise<ExistingSnapshot> {
    if (!idSchema.safeParse(snapshotId).success) throw new NotFoundError('SNAPSHOT_NOT_FOUND', `snapshot ${snapshotId} does not exist`);
    const { state } = await this.stream.load(snapshotId);
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
    const r = await this.stream.run(
      snapshotId,
      { type: 'DeleteSnapshot', data: { snapshot_id: snapshotId, reason: opts.reason ?? 'client', forced: opts.force ?? false } },
      actor,
    );
    // Deleted meanwhile by a racing call (nothing appended): that call releases the quota and drops the copies.
    if (r.position === undefined) return r;
    if (s.quota_counted || s.mode === 'build') await this.quota.release(s.tenant_id, snapshotId, actor);
    const dropped = await this.dropCopies(r.snapshot, actor);
    // The last position this call appended: a drop that appended nothing (the GC dropped that copy first) does not
    // hide the delete's (a caller tells "deleted now" from "already deleted" by it).
    return dropped ? { ...dropped, position: dropped.position ?? r.position } : r;
  }

  async requestExport(snapshotId: string, destination: string, actor: Actor): Promise<SnapshotResult> {
    await this.get(snapshotId, actor);
    return this.stream.run(snapshotId, { type: 'RequestExport', data: { snapshot_id: snapshotId, destination } }, actor);
  }

  async updateExport(
    snapshotId: string,
    destination: string,
    status: 'pending' | 'running' | 'done' | 'failed',
    error: string | undefined,
    actor: Actor,
  ): Promise<SnapshotResult> {
    await this.get(snapshotId, actor);
    return this.stream.run(snapshotId, { type: 'UpdateExport', data: { snapshot_id: snapshotId, destination, status, error } }, actor);
  }

  /** A layer-cache hit counts as use (idle collection reads it). */
  async recordUse(snapshotId: string, meta: CommandMeta): Promise<void> {
    await this.stream
      .run(snapshotId, { type: 'RecordUse', data: { snapshot_id: snapshotId } }, meta)
      .catch((err: unknown) =>
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
        last = await this.stream.run(s.snapshot_id, { type: 'DropArtifact', data: { snapshot_id: s.snapshot_id, host_id: hostId } }, meta);
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
  ensureOn(snapshotId: string, hostId: string, actor: Actor): Promise<void> {
    return this.copies.run(`${snapshotId}@${hostId}`, () => this.copyTo(snapshotId, hostId, actor));
  }

  private async copyTo(snapshotId: string, hostId: string, actor: Actor): Promise<void> {
    const s = await this.get(snapshotId, actor);
    if (s.status !== 'ready')
      throw new ConflictError('SNAPSHOT_NOT_READY', `snapshot ${snapshotId} is ${s.status}`, { snapshot_id: snapshotId, state: s.status });
    if (s.holders.includes(hostId)) {
      await this.recordUse(snapshotId, actor);
      return;
    }
    await this.move(s, hostId, actor);
  }

  /** Copies the artifact to `toHostId` (artifact-moves.ts). */
  move(s: ExistingSnapshot, toHostId: string, meta: CommandMeta): Promise<void> {
    return this.moves.move(s, toHostId, meta);
  }

  // ---------------------------------------------------------------- quota

  quotaUsage(tenantId: string): ReturnType<SnapshotQuota['usage']> {
    return this.quota.usage(tenantId);
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
    return this.stream.load(snapshotId);
  }
}
