import type { Logger } from 'pino';
import type { Pool } from 'pg';
import type { IngressSettings } from '../../commands/ingress/ingress-commands.js';
import type { Config } from '../config.js';
import { ActivityTracker } from './activity.js';
import { IngressPortHandlers, IngressProxy } from './ingress-proxy.js';
import { PgRouteSource } from './route-source.js';
import { Waker, type WakeVm } from './wake.js';

export { IngressPortHandlers, IngressProxy, TRAFFIC_TOKEN_HEADERS } from './ingress-proxy.js';
export type { IngressTarget, PortHandler, PortHandlerOptions } from './ingress-proxy.js';

/**
 * Whether this process runs the ingress proxy, and the URL settings: the
 * in-process proxy is on by default with the embedded default, and then the
 * domain defaults to `localhost:<INGRESS_PORT>` (browsers and curl send
 * `*.localhost` to loopback). Without a domain nothing is published.
 */
export function ingressSettingsOf(
  config: Config,
  embedded: boolean,
): { run: boolean; port: number; settings: IngressSettings | undefined } {
  const run = config.INGRESS_ENABLED ?? embedded;
  const port = config.INGRESS_PORT ?? (config.PORT > 0 && config.PORT < 65535 ? config.PORT + 1 : 8081);
  const domain = config.INGRESS_DOMAIN ?? (run ? `localhost:${port}` : undefined);
  return { run, port, settings: domain ? { domain, scheme: config.INGRESS_SCHEME } : undefined };
}

export interface RunningIngress {
  readonly proxy: IngressProxy;
  readonly url: string;
  readonly activity: ActivityTracker;
  close(): Promise<void>;
}

/** Starts a proxy over the route table in `pool`: in the control plane's process or in its own (`npm run ingress`). */
export async function startIngress(opts: {
  readonly pool: Pool;
  readonly domain: string;
  readonly host: string;
  readonly port: number;
  readonly routeCacheMs: number;
  readonly activityFlushMs: number;
  readonly recordActivity: (vmId: string) => Promise<void>;
  readonly handlers?: IngressPortHandlers | undefined;
  /** Resumes a paused VM on its first request (the in-process control plane's VmMemory); absent: no wake. */
  readonly wake?: WakeVm | undefined;
  /** How long a request to a paused VM waits for its resume (INGRESS_RESUME_TIMEOUT_MS). */
  readonly wakeTimeoutMs?: number | undefined;
  readonly logger: Logger;
}): Promise<RunningIngress> {
  const logger = opts.logger.child({ component: 'ingress' });
  const activity = new ActivityTracker(opts.recordActivity, Math.max(opts.activityFlushMs, 100), logger);
  const proxy = new IngressProxy({
    domain: opts.domain,
    routes: new PgRouteSource(opts.pool, opts.routeCacheMs),
    activity,
    handlers: opts.handlers,
    waker: opts.wake ? new Waker(opts.wake, opts.wakeTimeoutMs ?? 60_000) : undefined,
    logger,
  });
  const url = await proxy.listen(opts.port, opts.host);
  activity.start();
  logger.info({ url, domain: opts.domain }, 'ingress listening');
  return {
    proxy,
    url,
    activity,
    async close() {
      await proxy.close();
      await activity.stop();
    },
  };
}
