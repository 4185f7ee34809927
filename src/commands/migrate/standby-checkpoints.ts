import { randomBytes } from 'node:crypto';
import type { Logger } from 'pino';
import { AppError } from '@fleet/agent-protocol';
import type { HostState } from '../../domain/host/host.decider.js';
import { standbyAggregate } from '../../domain/standby/standby.aggregate.js';
import type { StandbyCommand, StandbyState } from '../../domain/standby/standby.decider.js';
import { bindAggregate, type BoundOf, type CommandHandler } from '../command-handler.js';
import type { HostCommands } from '../host/host-commands.js';
import { sandboxName, type Actor } from '../vm/vm-commands.js';
import { holdsGpus } from './gpu-memory.js';

const SYSTEM: Actor = { correlationId: 'standby-checkpoints', actor: 'standby-checkpoints', tenantId: 'system', admin: true };
const PREFIX = 'standby-';

/** A VM that may be checkpointed: running, on a host. */
export interface StandbyCandidate {
  readonly id: string;
  readonly state: string;
  readonly host_id: string | null;
}

export interface StandbyConfig {
  /** CHECKPOINT_INTERVAL_MS; 0 turns the loop off. */
  readonly intervalMs: number;
  /** How long a started tick is this replica's before another may take over (a replica that died mid-tick). */
  readonly leaseMs: number;
}

type Registered = Exclude<HostState, { status: 'unregistered' }>;

/** `standby-<vm id>-<8 hex>`: the sweep reads the VM back from the id. */
export const standbyCheckpointId = (vmId: string): string => `${PREFIX}${vmId}-${randomBytes(4).toString('hex')}`;
const vmOfCheckpoint = (id: string): string | undefined => /^standby-(.+)-[0-9a-f]{8}$/.exec(id)?.[1];

/**
 * Background checkpoints (the seed's CheckpointInterval): every interval
 * each running VM on a CRIU host is checkpointed live (it keeps running
 * after a brief freeze) and the checkpoint pulled by one other CRIU host of
 * the same backend, its standby; the VM's host keeps no copy. A live migrate
 * to the standby then pulls against that copy (`base_snapshot_id`) and
 * fetches only the content-defined chunks the copy does not hold. With no
 * memory dirty tracking on this kernel the dump itself is whole every time
 * (the VM is frozen for all of it); what changed is found by hashing, on
 * the hosts, not by the kernel. Each new copy
 * supersedes the last, which is removed; a sweep removes any `standby-*`
 * checkpoint on a host that is not its VM's current copy (a crash between
 * steps, a VM gone). These are agent checkpoints, not snapshots: they are
 * never listed as the tenant's and never counted against its quota.
 *
 * Runs on the replica holding the reconciler lease; a tick is claimed on the
 * VM's standby stream at the revision it was decided on, so a second replica
 * (a lease lost mid-tick) never checkpoints the same VM twice.
 */
export class StandbyCheckpoints {
  private readonly handler: BoundOf<typeof standbyAggregate>;
  private timer: NodeJS.Timeout | undefined;
  private ticking: Promise<void> | undefined;

  constructor(
    handler: CommandHandler,
    private readonly hosts: HostCommands,
    private readonly hostIds: () => Promise<string[]>,
    private readonly liveVms: () => Promise<StandbyCandidate[]>,
    private readonly config: StandbyConfig,
    private readonly logger: Logger,
  ) {
    this.handler = bindAggregate(handler, standbyAggregate);
  }

  get enabled(): boolean {
    return this.config.intervalMs > 0;
  }

  start(): void {
    if (!this.enabled || this.timer) return;
    this.timer = setInterval(() => {
      if (this.ticking) return;
      this.ticking = this.tick()
        .then(() => undefined)
        .catch((err: unknown) => this.logger.warn({ err: { message: (err as Error).message } }, 'standby checkpoint tick failed'))
        .finally(() => (this.ticking = undefined));
    }, this.config.intervalMs);
    this.timer.unref();
  }

  async stop(): Promise<void> {
    if (this.timer) clearInterval(this.timer);
    this.timer = undefined;
    await this.ticking;
  }

  async load(vmId: string): Promise<StandbyState> {
    return (await this.handler.load(vmId)).state;
  }

  /** The standby copy a live migrate to `targetHostId` can pull against, if that host holds the VM's. */
  async baseOn(vmId: string, targetHostId: string): Promise<string | undefined> {
    const cur = (await this.load(vmId)).current;
    return cur?.standby_host_id === targetHostId ? cur.checkpoint_id : undefined;
  }

  /** Where a live migrate with no target should go first (the seed's MigrateOptions.TargetHostID). */
  async standbyHostOf(vmId: string): Promise<string | undefined> {
    return (await this.load(vmId)).current?.standby_host_id;
  }

  /** One pass: a checkpoint of every running VM that is due, then the sweep. Answers the VMs checkpointed. */
  async tick(): Promise<string[]> {
    const hosts = await this.criuHosts();
    const done: string[] = [];
    for (const vm of await this.liveVms()) {
      if (vm.state !== 'running' || !vm.host_id) continue;
      const host = hosts.get(vm.host_id);
      // A VM holding GPUs has no memory state to copy (gpu-memory.ts): its host would refuse every tick.
      if (!host || holdsGpus(host, vm.id)) continue;
      try {
        if (await this.checkpointOne(vm.id, host, hosts)) done.push(vm.id);
      } catch (err) {
        this.logger.warn({ vm_id: vm.id, err: { message: (err as Error).message } }, 'standby checkpoint failed');
      }
    }
    await this.sweep(hosts);
    return done;
  }

  private async criuHosts(): Promise<Map<string, Registered>> {
    const out = new Map<string, Registered>();
    for (const id of await this.hostIds()) {
      const { state } = await this.hosts.load(id);
      if (state.status === 'unregistered' || state.capacity.live_snapshot !== true) continue;
      out.set(id, state);
    }
    return out;
  }

  private pickStandby(vmHost: Registered, hosts: Map<string, Registered>, current: string | undefined): Registered | undefined {
    const fit = [...hosts.values()].filter((h) => h.host_id !== vmHost.host_id && h.backend === vmHost.backend && h.status === 'active');
    return fit.find((h) => h.host_id === current) ?? fit.sort((a, b) => a.host_id.localeCompare(b.host_id))[0];
  }

  private async checkpointOne(vmId: string, host: Registered, hosts: Map<string, Registered>): Promise<boolean> {
    const before = await this.load(vmId);
    const standby = this.pickStandby(host, hosts, before.current?.standby_host_id);
    if (!standby) {
      // The only copy sits on the host the VM now runs on (it was migrated there): it stands by for nothing.
      if (before.current?.standby_host_id === host.host_id) await this.drop(vmId, 'standby_unfit', hosts);
      return false;
    }
    const cpId = standbyCheckpointId(vmId);
    const started = await this.run(vmId, {
      type: 'StartStandbyCheckpoint',
      data: {
        vm_id: vmId,
        checkpoint_id: cpId,
        host_id: host.host_id,
        standby_host_id: standby.host_id,
        interval_ms: this.config.intervalMs,
        lease_ms: this.config.leaseMs,
      },
    });
    // Not due, or another replica's tick is under way: nothing to do here.
    if (started.inflight?.checkpoint_id !== cpId) return false;
    const src = this.hosts.agentForState(host);
    const dst = this.hosts.agentForState(standby);
    try {
      const cp = await src.checkpoint(sandboxName(vmId), { id: cpId, live: true, comment: `standby of ${vmId} on ${standby.host_id}` });
      if (cp.kind !== 'live' || !cp.digest)
        throw new AppError('MEMORY_CHECKPOINT_UNSUPPORTED', 409, `host ${host.host_id} wrote no memory for vm ${vmId}`);
      const base = before.current?.standby_host_id === standby.host_id ? before.current.checkpoint_id : undefined;
      const grant = await src.grantArtifact(cpId, 600);
      const moved = await dst.pullArtifact({
        snapshot_id: cpId,
        digest: cp.digest,
        from: { url: host.url, grant: grant.grant, host_id: host.host_id },
        files: { ...cp.files },
        ...(base ? { base_snapshot_id: base } : {}),
      });
      await src.deleteCheckpoint(cpId);
      const after = await this.run(vmId, {
        type: 'CompleteStandbyCheckpoint',
        data: {
          vm_id: vmId,
          checkpoint_id: cpId,
          digest: cp.digest,
          files: cp.files,
          pause_ms: cp.pause_ms ?? 0,
          moved_bytes: moved.size_bytes,
          reused_bytes: moved.reused_bytes ?? 0,
        },
      });
      if (before.current && after.current?.checkpoint_id === cpId)
        await this.remove(before.current.standby_host_id, before.current.checkpoint_id, hosts);
      this.logger.info(
        { vm_id: vmId, standby: standby.host_id, moved_bytes: moved.size_bytes, reused_bytes: moved.reused_bytes ?? 0 },
        'standby checkpoint taken',
      );
      return true;
    } catch (err) {
      const e = err instanceof AppError ? err : undefined;
      await Promise.all([src, dst].map((a) => a.deleteCheckpoint(cpId).catch(() => undefined)));
      await this.run(vmId, {
        type: 'FailStandbyCheckpoint',
        data: { vm_id: vmId, checkpoint_id: cpId, error: (err as Error).message, error_code: e?.code },
      }).catch(() => undefined);
      throw err;
    }
  }

  private async drop(vmId: string, reason: 'vm_gone' | 'standby_unfit', hosts: Map<string, Registered>): Promise<void> {
    const cur = (await this.load(vmId)).current;
    await this.run(vmId, { type: 'DropStandbyCheckpoint', data: { vm_id: vmId, reason } });
    if (cur) await this.remove(cur.standby_host_id, cur.checkpoint_id, hosts);
  }

  /**
   * Every `standby-*` checkpoint on a CRIU host that is neither its VM's
   * current copy there nor a tick under way goes; a VM no longer running has
   * its copy dropped (recorded) first.
   */
  private async sweep(hosts: Map<string, Registered>): Promise<void> {
    const live = new Set((await this.liveVms()).filter((v) => v.state === 'running' || v.state === 'paused').map((v) => v.id));
    const now = Date.now();
    for (const h of hosts.values()) {
      let ids: string[];
      try {
        ids = (await this.hosts.agentForState(h).listCheckpoints()).map((c) => c.id).filter((id) => id.startsWith(PREFIX));
      } catch {
        continue;
      }
      for (const id of ids) {
        const vmId = vmOfCheckpoint(id);
        if (!vmId) continue;
        try {
          let s = await this.load(vmId);
          if (!live.has(vmId) && s.current) {
            await this.run(vmId, { type: 'DropStandbyCheckpoint', data: { vm_id: vmId, reason: 'vm_gone' } });
            s = await this.load(vmId);
          }
          const isCurrent = s.current?.checkpoint_id === id && s.current.standby_host_id === h.host_id;
          const underway = s.inflight?.checkpoint_id === id && Date.parse(s.inflight.until) > now;
          if (!isCurrent && !underway) await this.remove(h.host_id, id, hosts);
        } catch (err) {
          this.logger.warn({ checkpoint: id, host_id: h.host_id, err: { message: (err as Error).message } }, 'standby sweep step failed');
        }
      }
    }
  }

  private async remove(hostId: string, cpId: string, hosts: Map<string, Registered>): Promise<void> {
    const h = hosts.get(hostId);
    if (!h) return;
    await this.hosts
      .agentForState(h)
      .deleteCheckpoint(cpId)
      .catch((err: unknown) =>
        this.logger.warn({ checkpoint: cpId, host_id: hostId, err: { message: (err as Error).message } }, 'standby checkpoint not removed'),
      );
  }

  private async run(vmId: string, command: StandbyCommand): Promise<StandbyState> {
    return (await this.handler.handle(vmId, command, SYSTEM)).state;
  }
}
