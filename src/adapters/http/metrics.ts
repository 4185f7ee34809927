import { Counter, Gauge, Histogram, Registry, collectDefaultMetrics } from 'prom-client';

/** Computed at scrape time, read from memory or queried. */
type Samples<T> = T | Promise<T>;
/**
 * Prometheus metrics. Request metrics are counted here; gauges that describe
 * the fleet are read from the read models at scrape time (collect callbacks
 * registered by whoever owns the data), so they are never a second source of
 * truth that drifts.
 */
export class Metrics {
  readonly registry = new Registry();
  readonly httpRequests: Counter<'method' | 'route' | 'status'>;
  readonly httpDuration: Histogram<'method' | 'route'>;

  constructor(opts: { defaultMetrics?: boolean } = {}) {
    if (opts.defaultMetrics !== false) collectDefaultMetrics({ register: this.registry, prefix: 'fleet_process_' });
    this.httpRequests = new Counter({
      name: 'fleet_http_requests_total',
      help: 'HTTP requests by route and status',
      labelNames: ['method', 'route', 'status'],
      registers: [this.registry],
    });
    this.httpDuration = new Histogram({
      name: 'fleet_http_request_duration_seconds',
      help: 'HTTP request latency by route',
      labelNames: ['method', 'route'],
      buckets: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
      registers: [this.registry],
    });
  }

  /** A gauge whose values are computed at scrape time. */
  gauge<L extends string>(
    name: string,
    help: string,
    labelNames: readonly L[],
    collect: () => Samples<Array<{ labels: Record<L, string>; value: number }>>,
  ): void {
    const g: Gauge<L> = new Gauge<L>({
      name,
      help,
      labelNames: labelNames,
      registers: [this.registry],
      async collect() {
        const values = await collect();
        g.reset();
        for (const v of values) g.set(v.labels as never, v.value);
      },
    });
  }

  /**
   * A metric of any type (histogram, counter) whose samples are computed at
   * scrape time, e.g. from an event-derived table: prom-client's own types
   * keep state in this process, which a restart or another replica would not share.
   */
  custom(
    name: string,
    help: string,
    type: 'counter' | 'gauge' | 'histogram',
    collect: () => Samples<Array<{ suffix?: string; labels: Record<string, string | number>; value: number }>>,
  ): void {
    const metric = {
      name,
      help,
      type,
      aggregator: 'sum',
      reset: () => undefined,
      get: async () => ({
        name,
        help,
        type,
        aggregator: 'sum',
        values: (await collect()).map((v) => ({ metricName: `${name}${v.suffix ?? ''}`, labels: v.labels, value: v.value })),
      }),
    };
    this.registry.registerMetric(metric as never);
  }
}
