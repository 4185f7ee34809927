import type { Logger } from 'pino';
import { AppError, ConflictError } from '@fleet/agent-protocol';
import type { Position } from '../../domain/event-store.port.js';
import type { SnapshotKind } from '../../domain/snapshot/snapshot.events.js';
import type { ExistingVmState } from '../../domain/vm/vm.decider.js';
import type { HostCommands } from '../host/host-commands.js';
import type { Placer } from '../placement/place-and-reserve.js';
import type { SnapshotCommands } from '../snapshot/snapshot-commands.js';
import type { Actor, VmCommands } from '../vm/vm-commands.js';
import { forkSpec } from './fork-spec.js';
import { parseVmSpec } from '../../domain/vm/spec.js';
import { snapshotRequest } from '../snapshot/snapshot-request.js';

export const MAX_FORKS = 100;
/** Forks booted at once: each is a restore on some host, and a hundred at a time would only queue on their agents. */
const FORK_CONCURRENCY = 8;

export type ForkOutcome =
  | { readonly ok: true; readonly vm: ExistingVmState; readonly position?: Position | undefined }
  | { readonly ok: false; readonly error: { readonly code: string; readonly status: number; readonly message: string } };

export interface ForkManyResult {
  readonly snapshotId: string;
  /** `live`: every fork resumed the captured processes; `disk`: the source's host cannot capture memory, each fork booted its disk. */
  readonly kind: SnapshotKind;
  readonly forks: ForkOutcome[];
}

/**
 * A running VM branched N ways: one capture (live where the source's host
 * has CRIU, else disk as a plain fork does), restored N times, each a new VM
 * with its own id, token, MAC and address. Placement picks each fork's host
 * (only hosts that can restore memory for a live capture) and the capture is
 * copied to it under a grant, verified by its sha256s. One fork failing is
 * that fork's result, not the request's.
 */
export class LiveFork {
  constructor(
    private readonly hosts: HostCommands,
    private readonly placer: Placer,
    private readonly vms: VmCommands,
    private readonly snapshots: SnapshotCommands,
    private readonly logger: Logger,
  ) {}

  async forkMany(
    vmId: string,
    opts: { count: number; comment?: string | undefined; reuse_snapshot_id?: string | undefined },
    actor: Actor,
  ): Promise<ForkManyResult> {
    const src = await this.vms.get(vmId, actor);
    let snapshotId: string;
    let kind: SnapshotKind;
    if (opts.reuse_snapshot_id) {
      const s = await this.snapshots.get(opts.reuse_snapshot_id, actor);
      if (s.vm_id !== vmId)
        throw new ConflictError('SNAPSHOT_NOT_OF_VM', `snapshot ${s.snapshot_id} is of vm ${s.vm_id}, not ${vmId}`, {
          snapshot_id: s.snapshot_id,
        });
      if (s.status !== 'ready')
        throw new ConflictError('SNAPSHOT_NOT_READY', `snapshot ${s.snapshot_id} is ${s.status}`, { snapshot_id: s.snapshot_id });
      snapshotId = s.snapshot_id;
      kind = s.kind;
    } else {
      const host = src.host_id ? (await this.hosts.load(src.host_id)).state : undefined;
      const live = host !== undefined && host.status !== 'unregistered' && host.capacity.live_snapshot === true;
      const r = await this.snapshots.create(
        vmId,
        snapshotRequest({ mode: 'manual', comment: opts.comment ?? `fork of ${vmId}`, metadata: { fork_of: vmId }, live }),
        actor,
      );
      snapshotId = r.snapshot.snapshot_id;
      // What the agent wrote, not what was asked: a capture without memory forks as disk.
      kind = r.snapshot.kind;
    }
    const resume = kind === 'live';
    const excludeHosts = resume
      ? new Set((await this.placer.hosts()).filter((h) => h.capacity.live_snapshot !== true).map((h) => h.id))
      : undefined;
    const guest = this.vms.openGuestInputs(src);
    const spec = parseVmSpec(forkSpec(src.spec, snapshotId, guest));
    const forks: ForkOutcome[] = new Array<ForkOutcome>(opts.count);
    let next = 0;
    const worker = async (): Promise<void> => {
      for (let i = next++; i < opts.count; i = next++) {
        try {
          const r = await this.vms.create(spec, actor, undefined, { resume, excludeHosts });
          forks[i] = { ok: true, vm: r.vm, position: r.position };
        } catch (err) {
          const e = err instanceof AppError ? err : undefined;
          this.logger.warn({ vm_id: vmId, fork: i, code: e?.code, err: { message: (err as Error).message } }, 'a fork failed');
          forks[i] = { ok: false, error: { code: e?.code ?? 'INTERNAL', status: e?.status ?? 500, message: (err as Error).message } };
        }
      }
    };
    await Promise.all(Array.from({ length: Math.min(FORK_CONCURRENCY, opts.count) }, worker));
    return { snapshotId, kind, forks };
  }
}
