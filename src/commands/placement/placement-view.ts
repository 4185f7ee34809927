import { addReservation, hostAllocation, type HostState } from '../../domain/host/host.decider.js';
import {
  place,
  type Placement,
  type PlacementHost,
  type PlacementOptions,
  type PlacementRequest,
} from '../../domain/placement/placement.js';
import type { HostCommands } from '../host/host-commands.js';

/** Lists hosts with the stream revision the read model has seen (the `hosts` projection). */
export type HostDirectory = () => Promise<ReadonlyArray<{ id: string; revision: string }>>;

interface Entry {
  state: HostState;
  revision: bigint | 'no_stream';
}

/** What a decision in flight takes on its host until its reservation lands (or fails). */
interface Hold {
  readonly hostId: string;
  readonly cpus: number;
  readonly ram_mb: number;
  readonly storage_gb: number;
  readonly gpus: number;
  readonly gpu_profile: string | undefined;
  readonly gpu_uuids: readonly string[];
  readonly mig_instance_uuids: readonly string[];
}

/**
 * The placement view the command side decides on: each host's state folded
 * from its own stream, at a known revision. The read model only says which
 * hosts exist and how far each stream has gone; a host is re-read from its
 * stream when the read model is ahead of the cache, when a reservation
 * conflicts, or when a reservation of ours lands. Stale is safe: the host
 * decider re-checks the fit on the stream's own state and the reservation is
 * appended at the revision it was checked on, so a stale decision is refused
 * and made again — never over-commits.
 */
export class PlacementView {
  private readonly entries = new Map<string, Entry>();
  /** By vm id. Without them, concurrent creates all see the same best host and collide on its stream. */
  private readonly holds = new Map<string, Hold>();
  private reloading: Promise<void> | undefined;
  private loadedAt = 0;

  constructor(
    // Only reads host streams: any loader of host state will do (the host commands, or the bound host handler).
    private readonly hosts: Pick<HostCommands, 'load'>,
    private readonly directory: HostDirectory,
    private readonly maxAgeMs = 1000,
  ) {}

  async snapshot(): Promise<PlacementHost[]> {
    await this.fresh();
    return this.current();
  }

  /** Reloads from the directory when the cache is maxAgeMs old or older (0: always; a reload within the same millisecond counts). */
  async fresh(): Promise<void> {
    if (Date.now() - this.loadedAt >= this.maxAgeMs) await this.reload();
  }

  /** The view as it stands, with the holds of decisions in flight counted as allocated. */
  current(): PlacementHost[] {
    const held = new Map<string, Hold[]>();
    for (const [vmId, h] of this.holds) {
      const e = this.entries.get(h.hostId);
      // A reservation that already landed is in the state: counting its hold too would count it twice.
      if (!e || (e.state.status !== 'unregistered' && e.state.reservations.has(vmId))) continue;
      held.set(h.hostId, [...(held.get(h.hostId) ?? []), h]);
    }
    const out: PlacementHost[] = [];
    for (const e of this.entries.values()) {
      const p = toPlacementHost(e, held.get(e.state.status === 'unregistered' ? '' : e.state.host_id));
      if (p) out.push(p);
    }
    return out;
  }

  /**
   * Decides and holds the chosen host's share for `vmId` in one synchronous
   * step, so the next decision in this process already sees it: concurrent
   * creates spread over the fleet instead of herding onto one host. The hold
   * is an in-process hint only; the host stream stays the authority.
   */
  placeAndHold(vmId: string, req: PlacementRequest, opts: PlacementOptions): Placement {
    this.holds.delete(vmId);
    const choice = place(req, this.current(), opts);
    this.holds.set(vmId, {
      hostId: choice.decision.host_id,
      cpus: req.cpus,
      ram_mb: req.ram_mb,
      storage_gb: req.storage_gb,
      gpus: req.gpus ?? 0,
      gpu_profile: (req.gpus ?? 0) > 0 ? req.gpu_profile : undefined,
      gpu_uuids: choice.gpu_uuids,
      mig_instance_uuids: choice.mig_instance_uuids,
    });
    return choice;
  }

  /** Drops the hold of `vmId` (its reservation landed and is in the state, or it failed). */
  release(vmId: string): void {
    this.holds.delete(vmId);
  }

  /** Re-reads one host from its stream (after a conflict). */
  async refresh(hostId: string): Promise<void> {
    const { state, revision } = await this.hosts.load(hostId);
    this.set(hostId, state, revision);
  }

  /** Records a state we just appended, so the next decision in this process starts from it. */
  set(hostId: string, state: HostState, revision: bigint | 'no_stream'): void {
    const cur = this.entries.get(hostId);
    if (cur && typeof cur.revision === 'bigint' && typeof revision === 'bigint' && cur.revision > revision) return;
    this.entries.set(hostId, { state, revision });
  }

  invalidate(): void {
    this.loadedAt = 0;
  }

  private async reload(): Promise<void> {
    this.reloading ??= (async () => {
      try {
        const listed = await this.directory();
        const seen = new Set<string>();
        await Promise.all(
          listed.map(async ({ id, revision }) => {
            seen.add(id);
            const cur = this.entries.get(id);
            if (!cur || cur.revision === 'no_stream' || cur.revision < BigInt(revision)) await this.refresh(id);
          }),
        );
        // The directory lags the streams: a host it does not list yet may have been registered a moment ago (by this
        // process, which set it here), and one it no longer lists was deregistered. Ask the stream, never the lag.
        const unlisted = [...this.entries].filter(([id]) => !seen.has(id));
        for (const [id, e] of unlisted) if (e.state.status === 'deregistered' || e.revision === 'no_stream') this.entries.delete(id);
        await Promise.all(unlisted.filter(([id]) => this.entries.has(id)).map(([id]) => this.refresh(id)));
        this.loadedAt = Date.now();
      } finally {
        this.reloading = undefined;
      }
    })();
    await this.reloading;
  }
}

function toPlacementHost(e: Entry, holds: readonly Hold[] = []): PlacementHost | undefined {
  const s = e.state;
  if (s.status === 'unregistered' || s.status === 'deregistered' || e.revision === 'no_stream') return undefined;
  const allocated = hostAllocation(s);
  for (const h of holds) addReservation(allocated, h);
  return {
    id: s.host_id,
    state: s.status,
    backend: s.backend,
    region: s.region,
    arch: s.capacity.arch,
    labels: s.labels,
    capacity: s.capacity,
    cpu_overcommit_ratio: s.cpu_overcommit_ratio,
    allocated,
    revision: e.revision,
  };
}
