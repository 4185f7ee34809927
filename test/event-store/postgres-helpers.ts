import type { Subscription } from 'rxjs';
import type { PostgresEventStore } from '../../src/adapters/postgres/postgres-event-store.js';
import type { RecordedEvent, SubscriptionItem } from '../../src/domain/event-store.port.js';

/** Shared by the Postgres event store tests: bounded waits and a subscription that records what it is given. */

export const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

export async function until(what: string, check: () => boolean | Promise<boolean>, timeoutMs = 10_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(20);
  }
}

export function record(
  store: PostgresEventStore,
  options: Parameters<PostgresEventStore['subscribeToAll']>[0],
): { items: SubscriptionItem[]; sub: Subscription; errors: unknown[] } {
  const items: SubscriptionItem[] = [];
  const errors: unknown[] = [];
  const sub = store.subscribeToAll(options).subscribe({ next: (i) => items.push(i), error: (e: unknown) => errors.push(e) });
  return { items, sub, errors };
}

export const eventsOf = (items: SubscriptionItem[]): RecordedEvent[] => items.flatMap((i) => (i.kind === 'event' ? [i.event] : []));
