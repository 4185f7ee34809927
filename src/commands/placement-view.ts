import { hostAllocation, type HostState } from '../domain/host/host.decider.js';
import type { PlacementHost } from '../domain/placement/placement.js';
import type { HostCommands } from './host-commands.js';

/** Lists hosts with the stream revision the read model has seen (the `hosts` projection). */
export type HostDirectory = () => Promise<ReadonlyArray<{ id: string; revision: string }>>;

interface Entry {
  state: HostState;
  revision: bigint | 'no_stream';
}

/**
 * The placement view the command side decides on: each host's state folded
 * from its own stream, at a known revision. The read model only says which
 * hosts exist and how far each stream has gone; a host is re-read from its
 * stream when the read model is ahead of the cache, when a reservation
 * conflicts, or when a reservation of ours lands. Stale is safe: the
 * reservation is appended at the revision the decision saw, so a stale
 * decision loses a conflict and is made again — never over-commits.
 */
export class PlacementView {
  private readonly entries = new Map<string, Entry>();
  private reloading: Promise<void> | undefined;
  private loadedAt = 0;

  constructor(
    private readonly hosts: HostCommands,
    private readonly directory: HostDirectory,
    private readonly maxAgeMs = 1000,
  ) {}

  async snapshot(): Promise<PlacementHost[]> {
    if (Date.now() - this.loadedAt > this.maxAgeMs) await this.reload();
    const out: PlacementHost[] = [];
    for (const e of this.entries.values()) {
      const p = toPlacementHost(e);
      if (p) out.push(p);
    }
    return out;
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
        for (const id of this.entries.keys()) if (!seen.has(id)) this.entries.delete(id);
        this.loadedAt = Date.now();
      } finally {
        this.reloading = undefined;
      }
    })();
    await this.reloading;
  }
}

function toPlacementHost(e: Entry): PlacementHost | undefined {
  const s = e.state;
  if (s.status === 'unregistered' || s.status === 'deregistered' || e.revision === 'no_stream') return undefined;
  return {
    id: s.host_id,
    state: s.status,
    backend: s.backend,
    region: s.region,
    arch: s.capacity.arch,
    labels: s.labels,
    capacity: s.capacity,
    allocated: hostAllocation(s),
    revision: e.revision,
  };
}
