import type { ServerResponse } from 'node:http';
import type { FastifyInstance } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import type { Logger } from 'pino';
import type { Subscription } from 'rxjs';
import { z } from 'zod';
import { AppError, ForbiddenError } from '@fleet/agent-protocol';
import type { EventStore, RecordedEvent } from '../../domain/event-store.port.js';
import { FEED_TYPES, toEnvironmentEvent } from '../../domain/vm/vm.feed.js';
import { problemResponses } from './common.js';

export { toEnvironmentEvent, type EnvironmentEvent } from '../../domain/vm/vm.feed.js';

/** A VM's tenant never changes, so it is cached; a miss reads the stream's first event (VmRequested). */
export class VmTenants {
  private readonly cache = new Map<string, string>();
  constructor(
    private readonly store: EventStore,
    private readonly max = 200_000,
  ) {}

  remember(streamId: string, tenant: string): void {
    if (this.cache.size >= this.max) this.cache.clear();
    this.cache.set(streamId, tenant);
  }

  async of(recorded: RecordedEvent): Promise<string | undefined> {
    if (recorded.type === 'VmRequested') {
      const t = (recorded.data as { tenant_id?: unknown } | null)?.tenant_id;
      if (typeof t === 'string') {
        this.remember(recorded.streamId, t);
        return t;
      }
    }
    const hit = this.cache.get(recorded.streamId);
    if (hit !== undefined) return hit;
    const [first] = await this.store.readStream(recorded.streamId, { maxCount: 1 });
    const t = first?.type === 'VmRequested' ? (first.data as { tenant_id?: unknown } | null)?.tenant_id : undefined;
    if (typeof t !== 'string') return undefined;
    this.remember(recorded.streamId, t);
    return t;
  }
}

/** Live state of the feed's connections, for /metrics (consumer lag). */
export class FeedStats {
  readonly clients = new Set<{ queued(): number; bufferedBytes(): number; oldestPendingMs(): number | undefined }>();
  readonly disconnects = new Map<string, number>();
  countDisconnect(reason: string): void {
    this.disconnects.set(reason, (this.disconnects.get(reason) ?? 0) + 1);
  }
}

export interface EventsRoutesDeps {
  readonly store: EventStore;
  readonly logger?: Logger | undefined;
  readonly stats?: FeedStats | undefined;
  readonly heartbeatMs?: number | undefined;
  /** Bytes written but not yet taken by the client; past this the client is cut off. */
  readonly maxBufferBytes?: number | undefined;
  /** Events received from the store but not yet written; past this the client is cut off. */
  readonly maxQueuedEvents?: number | undefined;
  /** Grace for the closing error frame to drain before the socket is destroyed. */
  readonly closeGraceMs?: number | undefined;
  /** During catch-up the feed waits for the client to take what was sent; a client that takes nothing for this long is cut off. */
  readonly stallTimeoutMs?: number | undefined;
  /** Open feeds per caller (the admin key counts as one); one more is refused with 429 TOO_MANY_EVENT_STREAMS. */
  readonly maxPerTenant?: number | undefined;
}

/**
 * `GET /v1/events`: the caller's VM lifecycle as Server-Sent Events. The SSE
 * id is the event's position, so a reconnect with `Last-Event-ID` catches up
 * from the store exactly after it and then goes live: no loss, no repeats.
 * Catch-up pulls pages and waits for the socket to drain between them, so a
 * long history costs no more memory than a page; live events are pushed, and
 * a client that cannot take them is cut off with an `event: error` frame
 * naming why, never buffered without end.
 */
export function eventsRoutes(deps: EventsRoutesDeps) {
  const tenants = new VmTenants(deps.store);
  const heartbeatMs = deps.heartbeatMs ?? 15_000;
  const maxBufferBytes = deps.maxBufferBytes ?? 1024 * 1024;
  const maxQueued = deps.maxQueuedEvents ?? 10_000;
  const closeGraceMs = deps.closeGraceMs ?? 5_000;
  const stallTimeoutMs = deps.stallTimeoutMs ?? 60_000;
  const maxPerTenant = deps.maxPerTenant ?? 8;
  const openPerCaller = new Map<string, number>();
  const filter = { streamPrefixes: ['vm-'], eventTypes: FEED_TYPES };
  // eslint-disable-next-line @typescript-eslint/require-await -- a fastify plugin that returns no promise must call done()
  return async (scope: FastifyInstance): Promise<void> => {
    const app = scope.withTypeProvider<ZodTypeProvider>();
    // Open feeds would keep the server from closing: end them first, with a reason.
    const open = new Set<() => void>();
    // eslint-disable-next-line @typescript-eslint/require-await -- fastify waits for done() unless a hook returns a promise
    app.addHook('preClose', async () => {
      for (const end of [...open]) end();
    });
    app.get(
      '/v1/events',
      {
        schema: {
          tags: ['events'],
          summary: 'Live VM lifecycle events (text/event-stream); resume with Last-Event-ID',
          querystring: z.object({ tenant: z.string().min(1).max(200).optional(), last_event_id: z.string().optional() }),
          headers: z.object({ 'last-event-id': z.string().optional() }).loose(),
          response: { ...problemResponses },
        },
      },
      async (req, reply) => {
        const resumeFrom = req.headers['last-event-id'] ?? req.query.last_event_id;
        const after = resumeFrom !== undefined && resumeFrom !== '' ? deps.store.parsePosition(resumeFrom) : undefined;
        let tenantScope: string | undefined;
        if (req.caller.admin) tenantScope = req.query.tenant;
        else {
          if (req.query.tenant !== undefined && req.query.tenant !== req.caller.tenantId)
            throw new ForbiddenError('a tenant key watches its own events only; leave out tenant= or use the admin key');
          tenantScope = req.caller.tenantId;
        }

        // Checked last, so a refused request costs nothing; counted until this response closes.
        const who = req.caller.actor;
        const already = openPerCaller.get(who) ?? 0;
        if (already >= maxPerTenant) {
          throw new AppError(
            'TOO_MANY_EVENT_STREAMS',
            429,
            `you already have ${already} open event streams (SSE_MAX_PER_TENANT=${maxPerTenant}); close one, or resume with Last-Event-ID on the one you keep`,
            { limit: maxPerTenant },
          );
        }
        openPerCaller.set(who, already + 1);
        reply.raw.once('close', () => {
          const n = (openPerCaller.get(who) ?? 1) - 1;
          if (n <= 0) openPerCaller.delete(who);
          else openPerCaller.set(who, n);
        });

        reply.hijack();
        const res: ServerResponse = reply.raw;
        res.writeHead(200, {
          'content-type': 'text/event-stream; charset=utf-8',
          'cache-control': 'no-cache, no-transform',
          connection: 'keep-alive',
          'x-accel-buffering': 'no',
        });
        res.write('retry: 2000\n\n');

        const queue: RecordedEvent[] = [];
        let draining = false;
        let closed = false;
        // Read (by `cleanup`) before it is assigned: as a const that read would throw.
        // eslint-disable-next-line prefer-const -- see above
        let sub: Subscription | undefined;
        const client = {
          queued: () => queue.length,
          bufferedBytes: () => res.writableLength,
          oldestPendingMs: () => queue[0]?.created.getTime(),
        };
        deps.stats?.clients.add(client);
        const heartbeat = setInterval(() => {
          if (!closed) res.write(`: heartbeat ${new Date().toISOString()}\n\n`);
        }, heartbeatMs);
        heartbeat.unref();

        const cleanup = (reason: string): void => {
          if (closed) return;
          closed = true;
          clearInterval(heartbeat);
          sub?.unsubscribe();
          queue.length = 0;
          deps.stats?.clients.delete(client);
          deps.stats?.countDisconnect(reason);
        };
        // `closed` flips in the 'close' handler while this request awaits: read it through a call, not a narrowed local.
        const isClosed = (): boolean => closed;
        const fail = (code: string, message: string): void => {
          if (closed) return;
          cleanup(code.toLowerCase());
          res.write(`event: error\ndata: ${JSON.stringify({ code, message })}\n\n`);
          res.end();
          // A client that reads nothing would hold the socket (and the frame) forever.
          setTimeout(() => res.destroy(), closeGraceMs).unref();
        };
        res.on('close', () => cleanup('client_closed'));
        const onShutdown = (): void => fail('FEED_CLOSED', 'the server is shutting down; reconnect with Last-Event-ID to resume');
        open.add(onShutdown);
        res.on('close', () => open.delete(onShutdown));

        const drain = async (): Promise<void> => {
          if (draining) return;
          draining = true;
          try {
            while (!closed) {
              const recorded = queue.shift();
              if (recorded === undefined) break;
              await send(recorded);
              if (res.writableLength > maxBufferBytes) {
                fail(
                  'SLOW_CONSUMER',
                  `disconnected: more than ${maxBufferBytes} bytes were waiting for this client to read; reconnect with the last Last-Event-ID received to resume`,
                );
                return;
              }
            }
          } catch (err) {
            deps.logger?.warn({ err }, 'event feed failed');
            fail('FEED_FAILED', 'the event feed failed; reconnect with Last-Event-ID to resume');
          } finally {
            draining = false;
          }
        };

        /** Writes one event if the caller may see it. */
        const send = async (recorded: RecordedEvent): Promise<void> => {
          const env = toEnvironmentEvent(recorded);
          if (!env) return;
          if (tenantScope !== undefined && (await tenants.of(recorded)) !== tenantScope) return;
          if (!closed) res.write(`id: ${env.id}\ndata: ${JSON.stringify(env)}\n\n`);
        };
        const drained = (): Promise<boolean> =>
          new Promise((resolve) => {
            const done = (ok: boolean): void => {
              clearTimeout(timer);
              res.off('drain', onDrain);
              res.off('close', onClose);
              resolve(ok);
            };
            const onDrain = (): void => done(true);
            const onClose = (): void => done(false);
            const timer = setTimeout(() => done(false), stallTimeoutMs);
            res.on('drain', onDrain);
            res.on('close', onClose);
          });

        let position = after;
        try {
          for (;;) {
            const page = await deps.store.readAll({ after: position, maxCount: 500, filter });
            for (const e of page) {
              if (isClosed()) return;
              await send(e);
              position = e.position;
            }
            if (isClosed()) return;
            if (res.writableLength > maxBufferBytes / 2 && !(await drained())) {
              fail(
                'SLOW_CONSUMER',
                `disconnected: the client took nothing for ${stallTimeoutMs} ms while catching up; reconnect with the last Last-Event-ID received to resume`,
              );
              return;
            }
            if (page.length < 500) break;
          }
        } catch (err) {
          deps.logger?.warn({ err }, 'event feed catch-up failed');
          fail('FEED_FAILED', 'the event feed failed; reconnect with Last-Event-ID to resume');
          return;
        }
        if (isClosed()) return;
        res.write(`: caught-up ${position ?? ''}\n\n`);

        sub = deps.store.subscribeToAll({ after: position, filter }).subscribe({
          next: (item) => {
            if (closed) return;
            if (item.kind !== 'event') return;
            queue.push(item.event);
            if (queue.length > maxQueued) {
              fail(
                'SLOW_CONSUMER',
                `disconnected: more than ${maxQueued} events were waiting to be sent to this client; reconnect with Last-Event-ID to resume`,
              );
              return;
            }
            void drain();
          },
          error: (err: unknown) => {
            deps.logger?.warn({ err }, 'event feed subscription failed');
            fail('EVENT_STORE_UNAVAILABLE', 'the event store subscription failed; reconnect with Last-Event-ID to resume');
          },
          complete: () => fail('FEED_CLOSED', 'the server is shutting down; reconnect with Last-Event-ID to resume'),
        });
        if (isClosed()) sub.unsubscribe();
      },
    );
  };
}
