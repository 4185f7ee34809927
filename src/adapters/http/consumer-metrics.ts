import type { Pool } from 'pg';
import type { EventStore } from '../../domain/event-store.port.js';
import { bootHistogram, EVENT_COUNTERS, eventCounters } from '../../projections/metrics/metrics.projection.js';
import type { ProjectionRunner } from '../../projections/runner.js';
import type { FeedStats } from './events.routes.js';
import type { Metrics } from './metrics.js';

/** Lag in events is counted up to this many; beyond it the gauge reads the cap (a scrape must stay cheap). */
export const LAG_COUNT_CAP = 1000;

/** Metrics of the subscription consumers: event-derived figures, projection and feed lag. */
export function registerConsumerMetrics(
  metrics: Metrics,
  deps: { pool: Pool; store: EventStore; runner: ProjectionRunner; feed: FeedStats },
): void {
  metrics.custom('fleet_vm_boot_duration_seconds', 'VM boot durations (VmBooted boot_ms), from the event log', 'histogram', async () => {
    const h = await bootHistogram(deps.pool);
    return [
      ...h.buckets.map((b) => ({
        suffix: '_bucket',
        labels: { le: b.le === Number.POSITIVE_INFINITY ? '+Inf' : String(b.le) },
        value: b.count,
      })),
      { suffix: '_sum', labels: {}, value: h.sumSeconds },
      { suffix: '_count', labels: {}, value: h.count },
    ];
  });

  metrics.gauge(
    'fleet_projection_lag_events',
    `Events in the log not yet applied per read model (counted up to ${LAG_COUNT_CAP})`,
    ['projection'],
    async () => {
      const head = await deps.store.headPosition();
      return Promise.all(
        deps.runner.status().map(async (s) => {
          let value = 0;
          if (head !== undefined && (s.position === undefined || s.position < head)) {
            value = (await deps.store.readAll({ after: s.position, maxCount: LAG_COUNT_CAP })).length;
          }
          return { labels: { projection: s.name }, value };
        }),
      );
    },
  );

  metrics.gauge('fleet_feed_clients', 'Open live event feed (SSE) connections', [], () => [{ labels: {}, value: deps.feed.clients.size }]);
  metrics.gauge('fleet_feed_lag_events', 'Largest number of events received but not yet sent to one feed client', [], () => [
    { labels: {}, value: Math.max(0, ...[...deps.feed.clients].map((c) => c.queued())) },
  ]);
  metrics.gauge('fleet_feed_lag_seconds', 'Age of the oldest event not yet sent to any feed client', [], () => {
    const now = Date.now();
    const oldest = [...deps.feed.clients].map((c) => c.oldestPendingMs()).filter((t): t is number => t !== undefined);
    return [{ labels: {}, value: oldest.length ? Math.max(0, (now - Math.min(...oldest)) / 1000) : 0 }];
  });
  metrics.gauge('fleet_feed_buffered_bytes', 'Largest number of bytes written but not yet read by one feed client', [], () => [
    { labels: {}, value: Math.max(0, ...[...deps.feed.clients].map((c) => c.bufferedBytes())) },
  ]);
  metrics.custom('fleet_feed_disconnects_total', 'Feed connections ended, by reason (slow_consumer, client_closed, …)', 'counter', () =>
    [...deps.feed.disconnects].map(([reason, value]) => ({ labels: { reason }, value })),
  );
  metrics.custom(
    'fleet_feed_fallbacks_total',
    'Live feeds that fell behind (more than 10,000 live events waiting) and went back to catching up from the store',
    'counter',
    () => [{ labels: {}, value: deps.feed.fallbacks }],
  );

  for (const [name, def] of Object.entries(EVENT_COUNTERS)) {
    metrics.custom(name, def.help, 'counter', async () => {
      const stored = (await eventCounters(deps.pool)).filter((c) => c.name === name);
      const key = (l: Record<string, string>): string => JSON.stringify(Object.entries(l).sort());
      const seen = new Set(stored.map((c) => key(c.labels)));
      const zeros = (def.labels as ReadonlyArray<Record<string, string>>)
        .filter((l) => !seen.has(key(l)))
        .map((labels) => ({ labels, value: 0 }));
      return [...stored.map((c) => ({ labels: c.labels, value: c.value })), ...zeros];
    });
  }
}
