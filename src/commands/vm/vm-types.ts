import type { Position } from '../../domain/event-store.port.js';
import type { EgressRegistry } from '../../domain/egress/egress-registry.js';
import type { SpecLimits } from '../../domain/vm/spec.js';
import type { ExistingVmState } from '../../domain/vm/vm.decider.js';
import type { CommandMeta } from '../command-handler.js';

export const vmTokenContext = (vmId: string): string => `vm:${vmId}`;

/** A VM's sealed guest inputs in clear, for a later boot of its disk (fork, migrate). */
export interface GuestInputs {
  readonly agentCommand: string | undefined;
  readonly drainCommand: string | undefined;
  readonly secrets: Record<string, string>;
}

export interface VmCommandsConfig {
  readonly limits: SpecLimits;
  readonly execDefaultTimeoutMs: number;
  readonly execMaxTimeoutMs: number;
  readonly startupScriptTimeoutMs: number;
  /** Exec/attach activity is recorded at most this often per VM (idle expiry needs minutes, not every call). */
  readonly activityCoalesceMs?: number;
  /** EGRESS_PROXIES; undefined: proxy-mode VMs are refused. */
  readonly egressRegistry?: EgressRegistry | undefined;
}

export interface VmResult {
  readonly vm: ExistingVmState;
  readonly position: Position | undefined;
}

/**
 * Where a seed snapshot's artifact is and how it gets to a host (the
 * snapshot commands implement it): placement prefers holders, and the
 * winner is given a copy before boot when it has none.
 */
export interface SeedArtifacts {
  /** Hosts holding the seed for this caller; SNAPSHOT_NOT_FOUND for another tenant's or a missing one. */
  holders(snapshotId: string, actor: Actor): Promise<ReadonlySet<string>>;
  /** Moves the artifact onto `hostId` unless it already holds it; records the move. */
  ensureOn(snapshotId: string, hostId: string, actor: Actor): Promise<void>;
}

/** For flows built on create (fork, migrate): hosts to avoid. */
export interface CreateOptions {
  readonly excludeHosts?: ReadonlySet<string> | undefined;
}

/** A caller: the tenant from its key, or an admin that may touch any tenant's VM. */
export interface Actor extends CommandMeta {
  readonly tenantId: string;
  readonly admin: boolean;
}
