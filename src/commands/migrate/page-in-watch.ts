import type { Logger } from 'pino';
import type { MemoryStatus } from '../../domain/host-agent.port.js';
import type { HostState } from '../../domain/host/host.decider.js';
import type { migrationAggregate } from '../../domain/migration/migration.decider.js';
import type { ExistingVmState } from '../../domain/vm/vm.decider.js';
import type { BoundOf } from '../command-handler.js';
import type { HostCommands } from '../host/host-commands.js';
import type { Actor, VmCommands } from '../vm/vm-commands.js';

/** How often the target's memory status is read while pages stream. */
const POLL_MS = 200;
/** A silent target is logged this often; it is never taken for lost on silence alone (the stream between the hosts may be fine). */
const SILENCE_LOG_MS = 60_000;

/** How a lazy move's page-in ended, as its watch saw it. */
export type PageInOutcome =
  | { readonly kind: 'done'; readonly status: MemoryStatus }
  /** The stream broke before every page was in: the VM is lost with its source. */
  | { readonly kind: 'broken'; readonly status: MemoryStatus }
  /** The VM ended (destroyed, failed) or left its target some other way before every page was in. */
  | { readonly kind: 'vm_ended'; readonly vm: ExistingVmState }
  /** The move this watch follows is no longer the VM's move in progress (it ended, or another watch ended it): nothing to do. */
  | { readonly kind: 'not_ours' }
  /** This process is shutting down: the next control plane adopts the page-in. */
  | { readonly kind: 'stopped' };

export interface PageInWatch {
  readonly vmId: string;
  readonly targetId: string;
  /** The move's own id (the checkpoint id of a CRIU move, the stream id of a qemu one): the migration state's `checkpoint_id`. */
  readonly moveId: string;
  readonly migrations: BoundOf<typeof migrationAggregate>;
  readonly vms: VmCommands;
  readonly logger: Logger;
  readonly isStopped: () => boolean;
  /** The target agent's memory status of the VM. */
  readonly status: () => Promise<MemoryStatus>;
}

/**
 * Follows a lazy move's page-in after its switch, for the CRIU and the qemu
 * moves alike, until it ends one way or another. Each round first checks
 * that the VM's migration in progress is still this move (a second watch of
 * the same move, on another replica or adopted after a restart, may have
 * ended it, and a later move must never be acted on by a stale watch), then
 * that the VM still runs on the target, then asks the target. A target that
 * does not answer is waited for: its host's loss ends the VM through the
 * reconciler, which this watch then sees.
 */
export async function followPageIn(w: PageInWatch, actor: Actor): Promise<PageInOutcome> {
  let silentSince: number | undefined;
  let loggedAt = 0;
  for (;;) {
    await new Promise((r) => setTimeout(r, POLL_MS));
    if (w.isStopped()) return { kind: 'stopped' };
    let vm: ExistingVmState;
    try {
      if (!(await isCurrentMove(w))) return { kind: 'not_ours' };
      vm = await w.vms.get(w.vmId, actor);
    } catch {
      continue;
    }
    if (vm.status !== 'running' || vm.host_id !== w.targetId) return { kind: 'vm_ended', vm };
    let status: MemoryStatus;
    try {
      status = await w.status();
      silentSince = undefined;
    } catch (err) {
      const now = Date.now();
      silentSince ??= now;
      if (now - loggedAt >= SILENCE_LOG_MS) {
        loggedAt = now;
        w.logger.warn(
          { vm_id: w.vmId, host_id: w.targetId, silent_ms: now - silentSince, err: { message: (err as Error).message } },
          'lazy migration: the target does not answer; still waiting (its loss ends the VM through the reconciler)',
        );
      }
      continue;
    }
    if (status.done) return (await isCurrentMove(w)) ? { kind: 'done', status } : { kind: 'not_ours' };
    if (status.error !== undefined) return (await isCurrentMove(w)) ? { kind: 'broken', status } : { kind: 'not_ours' };
  }
}

/** The VM's migration in progress is this lazy move, past its switch. */
export async function isCurrentMove(w: Pick<PageInWatch, 'vmId' | 'moveId' | 'migrations'>): Promise<boolean> {
  const { state: m } = await w.migrations.load(w.vmId);
  return m.status === 'in_progress' && m.lazy && m.switched && m.checkpoint_id === w.moveId;
}

/** A lazy move past its switch that a restarted control plane can take up: its hosts as they stand now. */
export interface AdoptableMove {
  readonly fromHostId: string;
  readonly targetId: string;
  readonly moveId: string;
  /** When its last step was recorded (the switch): where an adopted watch counts its page-in time from. */
  readonly lastAt: number;
  readonly source: HostState;
  readonly target: HostState;
  /** Who an adopted watch records as. */
  readonly actor: Actor;
}

/** The VM's lazy move past its switch, if it has one (LazyMigrate.adopt and QemuLiveMigrate.adopt decide whether it is theirs). */
export async function adoptableMove(
  migrations: BoundOf<typeof migrationAggregate>,
  hosts: Pick<HostCommands, 'load'>,
  vmId: string,
): Promise<AdoptableMove | undefined> {
  const { state: m } = await migrations.load(vmId);
  if (m.status !== 'in_progress' || !m.lazy || !m.switched || m.target_host_id === undefined || m.checkpoint_id === undefined)
    return undefined;
  const [{ state: source }, { state: target }] = await Promise.all([hosts.load(m.from_host_id), hosts.load(m.target_host_id)]);
  return {
    fromHostId: m.from_host_id,
    targetId: m.target_host_id,
    moveId: m.checkpoint_id,
    lastAt: Date.parse(m.last_at),
    source,
    target,
    actor: { correlationId: `lazy-adopt-${vmId}`, actor: 'reconciler', tenantId: 'system', admin: true },
  };
}
