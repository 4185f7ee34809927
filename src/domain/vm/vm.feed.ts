import type { Position, RecordedEvent } from '../event-store.port.js';
import type { Endpoint, VmEvent, VmEventType, VmPhase, VmStatus } from './vm.events.js';
import { isVmEventType, parseVmEvent } from './vm.events.js';
import type { VmEndReason } from './vm.lifecycle.js';

/** The seed's EnvironmentEvent: one VM lifecycle change as a client sees it (SSE feed, JSON events, webhooks). */
export interface EnvironmentEvent {
  /** The event's global position: also its SSE id, so `Last-Event-ID` resumes right after it. */
  readonly id: Position;
  readonly event: string;
  readonly vm_id: string;
  readonly state: VmStatus;
  /** vm.placed, vm.migrated: where it runs now. */
  readonly host_id?: string;
  readonly url?: string;
  /** vm.migrated: its endpoints on the new host. */
  readonly endpoints?: readonly Endpoint[];
  /** vm.destroying, vm.destroyed, vm.failed: why it ends. */
  readonly reason?: VmEndReason;
  readonly error?: string;
  readonly error_code?: string;
  readonly phase?: VmPhase;
  readonly exit_code?: number;
  /** vm.failed `exited`/`oom`: the signal that killed the init (instead of an exit code). */
  readonly exit_signal?: string;
  readonly updated_at: string;
}

const FEED: Partial<Record<VmEventType, { event: string; state: VmStatus }>> = {
  VmRequested: { event: 'vm.requested', state: 'requested' },
  VmPlaced: { event: 'vm.placed', state: 'placed' },
  VmBootStarted: { event: 'vm.booting', state: 'booting' },
  VmBooted: { event: 'vm.booted', state: 'running' },
  VmMigrated: { event: 'vm.migrated', state: 'running' },
  VmDestroyRequested: { event: 'vm.destroying', state: 'destroying' },
  VmDestroyed: { event: 'vm.destroyed', state: 'destroyed' },
  VmFailed: { event: 'vm.failed', state: 'failed' },
};
/** Stored event types the feed carries. */
export const FEED_TYPES: readonly string[] = Object.keys(FEED);
/** The feed's event names (`vm.booted`, …), for filters. */
export const FEED_EVENT_NAMES: readonly string[] = Object.values(FEED).map((f) => f.event);

function details(e: VmEvent): Partial<EnvironmentEvent> {
  switch (e.type) {
    case 'VmPlaced':
      return { host_id: e.data.host_id };
    case 'VmBooted':
      return { url: e.data.url };
    case 'VmMigrated':
      return { host_id: e.data.host_id, url: e.data.url, endpoints: e.data.endpoints };
    case 'VmDestroyRequested':
    case 'VmDestroyed':
      return { reason: e.data.reason };
    case 'VmFailed': {
      const d = e.data;
      return {
        reason: d.reason,
        error: d.error,
        phase: d.phase,
        ...(d.error_code !== undefined ? { error_code: d.error_code } : {}),
        ...(d.exit_code !== undefined ? { exit_code: d.exit_code } : {}),
        ...(d.exit_signal !== undefined ? { exit_signal: d.exit_signal } : {}),
      };
    }
    default:
      return {};
  }
}

/** Maps a stored VM event to the feed's shape; undefined for events the feed does not carry (or that do not parse). */
export function toEnvironmentEvent(
  recorded: RecordedEvent,
  parse: (r: RecordedEvent) => VmEvent = (r) => parseVmEvent(r.type, r.data, r.metadata),
): EnvironmentEvent | undefined {
  if (!isVmEventType(recorded.type)) return undefined;
  const kind = FEED[recorded.type];
  if (!kind) return undefined;
  let e: VmEvent;
  try {
    e = parse(recorded);
  } catch {
    return undefined;
  }
  return { id: recorded.position, event: kind.event, vm_id: e.data.vm_id, state: kind.state, ...details(e), updated_at: e.data.at };
}
