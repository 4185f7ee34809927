import assert from 'node:assert/strict';
import type { Pool } from 'pg';
import type { EventStore, RecordedEvent } from '../../src/domain/event-store.port.js';
import { hostAllocation, hostDecider, type HostState } from '../../src/domain/host/host.decider.js';
import { isHostEventType, parseHostEvent } from '../../src/domain/host/host.events.js';

/** Judging capacity from the event store itself (never the read model): shared by the race tests and the benchmark. */

export async function readAllEvents(store: EventStore): Promise<RecordedEvent[]> {
  const out: RecordedEvent[] = [];
  for (;;) {
    const page = await store.readAll({ after: out.at(-1)?.position, maxCount: 5000 });
    out.push(...page);
    if (page.length < 5000) return out;
  }
}

/** Folds every host stream from the log, checking after EVERY event that nothing exceeds capacity. */
export function foldHosts(events: readonly RecordedEvent[]): Map<string, HostState> {
  const hosts = new Map<string, HostState>();
  for (const e of events) {
    if (!e.streamId.startsWith('host-') || !isHostEventType(e.type)) continue;
    const s = hostDecider.evolve(hosts.get(e.streamId) ?? hostDecider.initialState, parseHostEvent(e.type, e.data));
    hosts.set(e.streamId, s);
    if (s.status === 'unregistered') continue;
    const a = hostAllocation(s);
    const c = s.capacity;
    assert.ok(
      a.cpus <= c.cpus && a.ram_mb <= c.ram_mb && a.storage_gb <= c.storage_gb && a.vm_count <= c.vm_count,
      `${e.streamId} over-committed at revision ${e.revision}: ${JSON.stringify(a)} of ${JSON.stringify(c)}`,
    );
  }
  return hosts;
}

/**
 * The whole log through a global read. A global read shows only what every
 * earlier transaction has settled (read models write in the same Postgres),
 * so wait until it holds every stored event before judging from it.
 */
export async function readSettledLog(store: EventStore, pool: Pool, timeoutMs = 60_000): Promise<RecordedEvent[]> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const all = await readAllEvents(store);
    const { rows } = await pool.query<{ n: string }>('SELECT count(*)::text AS n FROM es_events');
    if (all.length === Number(rows[0]!.n)) return all;
    if (Date.now() > deadline) throw new Error(`the global read shows ${all.length} of ${rows[0]!.n} events after ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 100));
  }
}
