import type { Logger } from 'pino';
import type { SnapshotDeleteReason } from '../../domain/snapshot/snapshot.events.js';
import type { ExistingSnapshot, SnapshotAggregate } from '../../domain/snapshot/snapshot.decider.js';
import type { CommandMeta, Loaded } from '../command-handler.js';
import type { Actor } from '../vm/vm-commands.js';

type Row = { id: string; tenant_id: string };

/** What collection needs of the snapshot commands (the streams decide every delete). */
export interface CollectableSnapshots {
  load(snapshotId: string): Promise<Loaded<SnapshotAggregate>>;
  delete(snapshotId: string, actor: Actor, opts: { reason: SnapshotDeleteReason }): Promise<unknown>;
  dropCopies(s: ExistingSnapshot, meta: CommandMeta): Promise<unknown>;
}

/** Candidates from the read models (they may lag). */
export interface GcReads {
  dependentsOf(snapshotId: string): Promise<string[]>;
  expired(now: Date): Promise<Row[]>;
  idleLayers(before: Date): Promise<Row[]>;
  layersOverCap(max: number): Promise<Row[]>;
  liveVmsSeededFrom(snapshotId: string): Promise<string[]>;
  deletedWithHolders(): Promise<Row[]>;
}

const SYSTEM: CommandMeta = { correlationId: 'snapshot-gc', actor: 'system:snapshot-gc' };

/** Snapshot and artifact collection, on a timer: candidates from the read model, every delete decided on the snapshot's stream. */
export class SnapshotGc {
  private timer: NodeJS.Timeout | undefined;
  private collecting: Promise<void> | undefined;

  constructor(
    private readonly snapshots: CollectableSnapshots,
    private readonly reads: GcReads,
    private readonly config: { readonly gcIntervalMs: number; readonly idleTtlMs: number; readonly maxPerTenant: number },
    private readonly logger: Logger,
  ) {}

  start(): void {
    if (this.timer) return;
    this.timer = setInterval(
      () =>
        void this.collect().catch((err: unknown) =>
          this.logger.warn({ err: { message: (err as Error).message } }, 'snapshot collection failed'),
        ),
      this.config.gcIntervalMs,
    );
    this.timer.unref();
  }

  async stop(): Promise<void> {
    if (this.timer) clearInterval(this.timer);
    this.timer = undefined;
    await this.collecting?.catch(() => undefined);
  }

  /**
   * One collection pass: snapshots past retention_until; layer artifacts idle
   * past ARTIFACT_IDLE_TTL; the LRU beyond ARTIFACT_MAX_PER_TENANT; unfinished
   * agent deletes. Never one a live VM seeds from or a lineage names.
   */
  async collect(now = new Date()): Promise<{ expired: number; idle: number; evicted: number; retried: number }> {
    if (this.collecting) {
      await this.collecting.catch(() => undefined);
    }
    const out = { expired: 0, idle: 0, evicted: 0, retried: 0 };
    const run = (async () => {
      for (const s of await this.reads.expired(now)) if (await this.collectOne(s, 'retention')) out.expired++;
      if (this.config.idleTtlMs > 0)
        for (const s of await this.reads.idleLayers(new Date(now.getTime() - this.config.idleTtlMs)))
          if (await this.collectOne(s, 'idle')) out.idle++;
      if (this.config.maxPerTenant > 0)
        for (const s of await this.reads.layersOverCap(this.config.maxPerTenant)) if (await this.collectOne(s, 'lru')) out.evicted++;
      for (const s of await this.reads.deletedWithHolders()) {
        const { state } = await this.snapshots.load(s.id);
        if (state.status === 'deleted' && state.holders.length > 0) {
          await this.snapshots.dropCopies(state, SYSTEM);
          out.retried++;
        }
      }
    })();
    this.collecting = run;
    try {
      await run;
    } finally {
      if (this.collecting === run) this.collecting = undefined;
    }
    return out;
  }

  private async collectOne(row: { id: string; tenant_id: string }, reason: SnapshotDeleteReason): Promise<boolean> {
    try {
      const users = await this.reads.liveVmsSeededFrom(row.id);
      if (users.length > 0) return false;
      if ((await this.reads.dependentsOf(row.id)).length > 0) return false;
      await this.snapshots.delete(row.id, { ...SYSTEM, tenantId: row.tenant_id, admin: true }, { reason });
      return true;
    } catch (err) {
      this.logger.warn({ snapshot_id: row.id, reason, err: { message: (err as Error).message } }, 'snapshot not collected');
      return false;
    }
  }
}
