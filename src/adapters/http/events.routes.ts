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
  /** Live feeds that fell more than maxQueuedEvents behind and went back to catching up from the store. */
  fallbacks = 0;
  countDisconnect(reason: string): void {
    this.disconnects.set(reason, (this.disconnects.get(reason) ?? 0) + 1);
  }
  countFallback(): void {
    this.fallbacks++;
  }
}

export interface EventsRoutesDeps {
  readonly store: EventStore;
  readonly logger?: Logger | undefined;
  readonly stats?: FeedStats | undefined;
  readonly heartbeatMs?: number | undefined;
  /** Bytes written but not yet taken by the client; past half of it the feed waits for the client to read. */
  readonly maxBufferBytes?: number | undefined;
  /** Live events received but not yet written; past this the feed drops its subscription and catches up from the store again. */
  readonly maxQueuedEvents?: number | undefined;
  /** Grace for the closing error frame to drain before the socket is destroyed. */
  readonly closeGraceMs?: number | undefined;
  /** The feed waits for the client to take what was sent; a client that takes nothing for this long is cut off. */
  readonly stallTimeoutMs?: number | undefined;
  /** Open feeds per caller (the admin key counts as one); one more is refused with 429 TOO_MANY_EVENT_STREAMS. */
  readonly maxPerTenant?: number | undefined;
}

/**
 * `GET /v1/events`: the caller's VM lifecycle as Server-Sent Events. The SSE
 * id is the event's position, so a reconnect with `Last-Event-ID` catches up
 * from the store exactly after it and then goes live: no loss, no repeats.
 * Catch-up pulls pages and waits for the socket to drain between them, so a
 * long history costs no more memory than a page; live events are pushed and
 * written as the socket takes them. A live client that falls too far behind
 * (a burst, or a catch-up that ended at the store's visibility horizon with
 * more committing behind it) is not cut off: the feed drops its subscription
 * and catches up from the store again, at the client's pace. Only a client
 * that takes nothing for the stall timeout is cut off, with an `event: error`
 * frame naming why; nothing is buffered without end.
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
        let closed = false;
        // The live tail's subscription while there is one (ended by `cleanup` too).
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
        /** Past half the buffer bound, waits for the client to take what was sent; false (and the client cut off) if it takes nothing. */
        const paced = async (): Promise<boolean> => {
          if (res.writableLength <= maxBufferBytes / 2) return true;
          if (await drained()) return true;
          fail(
            'SLOW_CONSUMER',
            `disconnected: the client took nothing for ${stallTimeoutMs} ms; reconnect with the last Last-Event-ID received to resume`,
          );
          return false;
        };

        // The last event handled (sent, or not the caller's): catch-up and the live tail both go on from it.
        let position = after;
        /** Pages from the store after `position` at the client's pace; true once a short page says it is caught up. */
        const catchUp = async (): Promise<boolean> => {
          for (;;) {
            const page = await deps.store.readAll({ after: position, maxCount: 500, filter });
            for (const e of page) {
              if (isClosed()) return false;
              await send(e);
              position = e.position;
            }
            if (isClosed() || !(await paced())) return false;
            if (page.length < 500) return true;
          }
        };
        /**
         * Pushed events from a subscription after `position`, written as the socket takes them. True when the client
         * falls more than `maxQueued` events behind (the caller catches up from the store again, at the client's pace,
         * instead of holding the backlog), false when the feed has ended.
         */
        const live = async (): Promise<boolean> => {
          let wake: (() => void) | undefined;
          // Set in the subscription's callback: read through a call, not a narrowed local.
          let behind = false;
          const isBehind = (): boolean => behind;
          const poke = (): void => {
            wake?.();
            wake = undefined;
          };
          const subscription = deps.store.subscribeToAll({ after: position, filter }).subscribe({
            next: (item) => {
              if (closed || behind || item.kind !== 'event') return;
              queue.push(item.event);
              if (queue.length > maxQueued) behind = true;
              poke();
            },
            error: (err: unknown) => {
              deps.logger?.warn({ err }, 'event feed subscription failed');
              fail('EVENT_STORE_UNAVAILABLE', 'the event store subscription failed; reconnect with Last-Event-ID to resume');
              poke();
            },
            complete: () => {
              fail('FEED_CLOSED', 'the server is shutting down; reconnect with Last-Event-ID to resume');
              poke();
            },
          });
          sub = subscription;
          // Closing the response must end the wait for the next event.
          res.once('close', poke);
          try {
            for (;;) {
              if (isClosed()) return false;
              if (isBehind()) return true;
              const recorded = queue.shift();
              if (recorded === undefined) {
                await new Promise<void>((r) => {
                  wake = r;
                  if (isClosed() || isBehind() || queue.length > 0) poke();
                });
                continue;
              }
              await send(recorded);
              position = recorded.position;
              if (!(await paced())) return false;
            }
          } finally {
            // Also when the client left before the subscription was made (cleanup had none to end then).
            res.off('close', poke);
            subscription.unsubscribe();
            sub = undefined;
            queue.length = 0;
          }
        };

        try {
          for (;;) {
            if (!(await catchUp())) return;
            res.write(`: caught-up ${position ?? ''}\n\n`);
            if (!(await live())) return;
            deps.stats?.countFallback();
          }
        } catch (err) {
          deps.logger?.warn({ err }, 'event feed failed');
          fail('FEED_FAILED', 'the event feed failed; reconnect with Last-Event-ID to resume');
        }
      },
    );
  };
}
