import {
  BACKWARDS,
  END,
  EventStoreDBClient,
  FORWARDS,
  START,
  AccessDeniedError,
  StreamNotFoundError,
  WrongExpectedVersionError,
  eventTypeFilter,
  excludeSystemEvents,
  jsonEvent,
  streamNameFilter,
  type AllStreamResolvedEvent,
  type AllStreamSubscription,
  type Filter,
  type JSONType,
  type Position as EsdbPosition,
} from '@eventstore/db-client';
import type { Logger } from 'pino';
import { Observable } from 'rxjs';
import { ValidationError } from '@fleet/agent-protocol';
import {
  ConcurrencyError,
  EventStoreUnavailableError,
  assertStreamName,
  checkMaxCount,
  formatPosition,
  parsePositionPair,
  validateAppend,
  type AppendResult,
  type EventFilter,
  type EventStore,
  type ExpectedRevision,
  type NewEvent,
  type Position,
  type ReadAllOptions,
  type ReadStreamOptions,
  type RecordedEvent,
  type SubscribeOptions,
  type SubscriptionItem,
} from '../../domain/event-store.port.js';
import { comparePos, drain, isWanted, toEsdbExpected, toEsdbMetadata, toEsdbPosition, toRecorded } from './esdb-mapping.js';
import { checkOptionKeys, describeEndpoint, errorText, invalidUrl, isFatal, isUnavailable, redactCredentials } from './esdb-connection.js';

/**
 * The EventStore port on EventStoreDB (≥ 23.10: the adapter relies on the
 * server's CaughtUp message), through the official gRPC client.
 * docs/eventstoredb.md says how to run it and which server features it needs.
 */

export interface EsdbEventStoreOptions {
  /** `esdb://host:2113?tls=false`, `esdb+discover://…` for a cluster. May hold credentials: never logged. */
  readonly connectionString: string;
  readonly logger?: Logger | undefined;
  /** Resubscription backoff after a drop: doubles from `initialMs` up to `maxMs`, with jitter. */
  readonly backoff?: { readonly initialMs?: number; readonly maxMs?: number } | undefined;
  /** How long `ping` waits for an answer. Default 5 s. */
  readonly pingTimeoutMs?: number | undefined;
  /** Server-side filter checkpoint multiplier (× the server's 32-event window). Default 1. */
  readonly checkpointInterval?: number | undefined;
}

const PAGE = 500;
/** uint64 max: how an absent position may come back from a server. */
const NO_POSITION = 0xffffffffffffffffn;

type Marker = { readonly marker: 'checkpoint'; readonly position: EsdbPosition } | { readonly marker: 'caught-up' };
type SubscriptionChunk = AllStreamResolvedEvent | Marker;

export class EsdbEventStore implements EventStore {
  readonly name = 'esdb' as const;
  private readonly client: EventStoreDBClient;
  private readonly endpoint: string;
  private readonly logger: Logger | undefined;
  private readonly backoffInitialMs: number;
  private readonly backoffMaxMs: number;
  private readonly pingTimeoutMs: number;
  private readonly checkpointInterval: number;
  private readonly live = new Set<() => void>();
  private closed = false;

  constructor(options: EsdbEventStoreOptions) {
    this.endpoint = describeEndpoint(options.connectionString);
    checkOptionKeys(options.connectionString);
    try {
      this.client = EventStoreDBClient.connectionString(options.connectionString);
    } catch (err) {
      throw invalidUrl(redactCredentials((err as Error).message, options.connectionString));
    }
    this.logger = options.logger?.child({ component: 'esdb-event-store', endpoint: this.endpoint });
    this.backoffInitialMs = options.backoff?.initialMs ?? 100;
    this.backoffMaxMs = options.backoff?.maxMs ?? 5_000;
    this.pingTimeoutMs = options.pingTimeoutMs ?? 5_000;
    this.checkpointInterval = options.checkpointInterval ?? 1;
  }

  async append(streamId: string, events: readonly NewEvent[], expected: ExpectedRevision): Promise<AppendResult> {
    const batch = validateAppend(streamId, events, expected);
    this.assertOpen();
    const payload = batch.events.map((e) =>
      jsonEvent({ id: e.id, type: e.type, data: e.data as JSONType, metadata: toEsdbMetadata(e.metadata) }),
    );
    try {
      const result = await this.client.appendToStream(batch.streamId, payload, { expectedRevision: toEsdbExpected(batch.expected) });
      const position = result.position;
      if (!position || position.commit === NO_POSITION || position.commit < 0n) {
        // Some servers answer an idempotent re-append without a position: take it from the event itself.
        const [last] = await this.readStream(batch.streamId, { fromRevision: result.nextExpectedRevision, maxCount: 1 });
        if (!last)
          throw new EventStoreUnavailableError(
            `EventStoreDB at ${this.endpoint} acknowledged ${batch.streamId}@${result.nextExpectedRevision} but the event cannot be read back`,
          );
        return { nextExpectedRevision: result.nextExpectedRevision, position: last.position };
      }
      return { nextExpectedRevision: result.nextExpectedRevision, position: formatPosition(position.commit, position.prepare) };
    } catch (err) {
      if (err instanceof WrongExpectedVersionError) {
        const actual = err.actualVersion;
        throw new ConcurrencyError(batch.streamId, batch.expected, typeof actual === 'bigint' ? actual : 'no_stream');
      }
      throw this.mapError(err, `append to ${batch.streamId}`);
    }
  }

  async readStream(streamId: string, options: ReadStreamOptions = {}): Promise<RecordedEvent[]> {
    assertStreamName(streamId);
    const maxCount = checkMaxCount(options.maxCount);
    if (options.fromRevision !== undefined && (typeof options.fromRevision !== 'bigint' || options.fromRevision < 0n)) {
      throw new ValidationError(
        'fromRevision must be a non-negative bigint',
        [{ path: 'fromRevision', message: 'not a non-negative bigint' }],
        'INVALID_REVISION',
      );
    }
    this.assertOpen();
    if (maxCount === 0) return [];
    const backwards = options.direction === 'backwards';
    const out: RecordedEvent[] = [];
    try {
      const events = await drain(
        this.client.readStream(streamId, {
          direction: backwards ? BACKWARDS : FORWARDS,
          fromRevision: options.fromRevision ?? (backwards ? END : START),
          maxCount: maxCount ?? Number.MAX_SAFE_INTEGER,
        }),
      );
      for (const resolved of events) {
        const recorded = toRecorded(resolved);
        if (recorded) out.push(recorded);
      }
    } catch (err) {
      if (err instanceof StreamNotFoundError) return [];
      throw this.mapError(err, `read ${streamId}`);
    }
    return out;
  }

  async readAll(options: ReadAllOptions = {}): Promise<RecordedEvent[]> {
    const maxCount = checkMaxCount(options.maxCount) ?? Number.POSITIVE_INFINITY;
    let from = options.after === undefined ? undefined : toEsdbPosition(options.after);
    this.assertOpen();
    const out: RecordedEvent[] = [];
    // The client reads $all without a server-side filter, from a position inclusively: page, skip, filter here.
    try {
      while (out.length < maxCount) {
        const page = await drain(this.client.readAll({ direction: FORWARDS, fromPosition: from ?? START, maxCount: PAGE }));
        let last: EsdbPosition | undefined;
        for (const resolved of page) {
          const event = resolved.event;
          if (!event?.position) continue;
          last = event.position;
          if (from && comparePos(event.position, from) <= 0) continue;
          if (!isWanted(event.streamId, event.type, options.filter)) continue;
          const recorded = toRecorded(resolved);
          if (recorded && out.length < maxCount) out.push(recorded);
        }
        if (page.length < PAGE || !last) break;
        from = last;
      }
    } catch (err) {
      throw this.mapError(err, 'read $all');
    }
    return out;
  }

  subscribeToAll(options: SubscribeOptions = {}): Observable<SubscriptionItem> {
    const wanted = options.filter;
    return new Observable<SubscriptionItem>((subscriber) => {
      if (this.closed) {
        subscriber.error(new EventStoreUnavailableError('the EventStoreDB event store is closed'));
        return;
      }
      let last: EsdbPosition | undefined;
      try {
        last = options.after === undefined ? undefined : toEsdbPosition(options.after);
      } catch (err) {
        subscriber.error(err);
        return;
      }
      let caughtUpSent = false;
      let attempt = 0;
      let stopped = false;
      let current: AllStreamSubscription | undefined;
      let timer: NodeJS.Timeout | undefined;

      const connect = (): void => {
        if (stopped) return;
        let done = false;
        const sub = this.client.subscribeToAll({ fromPosition: last ?? START, filter: this.serverFilter(wanted) });
        current = sub;
        const retry = (why: unknown): void => {
          if (done || stopped) return;
          done = true;
          void sub.unsubscribe().catch(() => undefined);
          if (isFatal(why)) {
            stopped = true;
            subscriber.error(this.mapError(why, 'subscribe to $all'));
            return;
          }
          const delay = Math.min(this.backoffMaxMs, this.backoffInitialMs * 2 ** attempt) * (0.75 + Math.random() * 0.5);
          attempt++;
          this.logger?.warn(
            { attempt, delayMs: Math.round(delay), err: errorText(why), after: last && formatPosition(last.commit, last.prepare) },
            'EventStoreDB subscription dropped; resubscribing',
          );
          timer = setTimeout(connect, delay);
        };
        // Checkpoints and caught-up go through the subscription's own buffer so
        // they reach the consumer strictly after the events that precede them:
        // a checkpoint overtaking a buffered event would skip that event on resume.
        sub.on('caughtUp', () => sub.push({ marker: 'caught-up' } satisfies Marker));
        sub.on('confirmation', () => {
          attempt = 0;
        });
        sub.on('data', (chunk: SubscriptionChunk) => {
          if (done || stopped) return;
          if ('marker' in chunk) {
            if (chunk.marker === 'caught-up') {
              if (!caughtUpSent) {
                caughtUpSent = true;
                subscriber.next({ kind: 'caught-up', position: last && formatPosition(last.commit, last.prepare) });
              }
              return;
            }
            if (last && comparePos(chunk.position, last) <= 0) return;
            last = chunk.position;
            subscriber.next({ kind: 'checkpoint', position: formatPosition(chunk.position.commit, chunk.position.prepare) });
            return;
          }
          const event = chunk.event;
          if (!event?.position) return;
          // After a resubscription the server starts after `last`; this guard keeps delivery exactly-once anyway.
          if (last && comparePos(event.position, last) <= 0) return;
          last = event.position;
          attempt = 0;
          if (!isWanted(event.streamId, event.type, wanted)) return;
          const recorded = toRecorded(chunk);
          if (recorded) subscriber.next({ kind: 'event', event: recorded });
        });
        sub.on('error', retry);
        sub.on('end', () => retry(new Error('subscription ended by the server')));
        sub.on('close', () => retry(new Error('subscription closed')));
      };

      const teardown = (): void => {
        if (stopped && !current) return;
        stopped = true;
        if (timer) clearTimeout(timer);
        const sub = current;
        current = undefined;
        if (sub) void sub.unsubscribe().catch(() => undefined);
        this.live.delete(complete);
      };
      const complete = (): void => {
        teardown();
        subscriber.complete();
      };
      this.live.add(complete);
      connect();
      return teardown;
    });
  }

  async headPosition(): Promise<Position | undefined> {
    this.assertOpen();
    let from: EsdbPosition | 'end' = END;
    try {
      // The newest event a reader of this port can see: system events do not count.
      for (;;) {
        const page: AllStreamResolvedEvent[] = await drain(
          this.client.readAll({ direction: BACKWARDS, fromPosition: from, maxCount: PAGE }),
        );
        for (const resolved of page) {
          const event = resolved.event;
          if (event?.position && !event.type.startsWith('$')) return formatPosition(event.position.commit, event.position.prepare);
        }
        const oldest = page.at(-1)?.event?.position;
        if (page.length < PAGE || !oldest) return undefined;
        from = oldest;
      }
    } catch (err) {
      throw this.mapError(err, 'read the head of $all');
    }
  }

  parsePosition(value: string): Position {
    parsePositionPair(value);
    return value;
  }

  async ping(): Promise<void> {
    this.assertOpen();
    const read = this.client.readAll({ direction: BACKWARDS, fromPosition: END, maxCount: 1 });
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error(`no answer within ${this.pingTimeoutMs} ms`)), this.pingTimeoutMs);
    });
    try {
      await Promise.race([drain(read), timeout]);
    } catch (err) {
      void read.cancel().catch(() => undefined);
      throw this.unavailable(err, 'ping');
    } finally {
      clearTimeout(timer);
    }
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    for (const complete of [...this.live]) complete();
    await this.client.dispose();
  }

  // ------------------------------------------------------------ internals

  private serverFilter(wanted: EventFilter | undefined): Filter {
    const common = {
      checkpointInterval: this.checkpointInterval,
      // Marks the checkpoint in the subscription's buffer (see subscribeToAll).
      checkpointReached: (sub: AllStreamSubscription, position: EsdbPosition) => {
        (sub as unknown as { push(chunk: Marker): boolean }).push({ marker: 'checkpoint', position });
      },
    };
    // One server-side filter per subscription: by stream prefix if given, else by
    // event type (prefix match; exact match is rechecked here), else "no system events".
    if (wanted?.streamPrefixes && wanted.streamPrefixes.length > 0)
      return streamNameFilter({ prefixes: [...wanted.streamPrefixes], ...common });
    if (wanted?.eventTypes && wanted.eventTypes.length > 0) return eventTypeFilter({ prefixes: [...wanted.eventTypes], ...common });
    return excludeSystemEvents(common);
  }

  private assertOpen(): void {
    if (this.closed) throw new EventStoreUnavailableError('the EventStoreDB event store is closed');
  }

  private mapError(err: unknown, what: string): Error {
    if (err instanceof ValidationError || err instanceof ConcurrencyError || err instanceof EventStoreUnavailableError) return err;
    if (isUnavailable(err)) return this.unavailable(err, what);
    if (err instanceof AccessDeniedError) {
      return new EventStoreUnavailableError(
        `EventStoreDB at ${this.endpoint} denied access to ${what}: put a user with access in EVENTSTORE_URL`,
        { cause: err },
      );
    }
    return err instanceof Error ? err : new Error(String(err));
  }

  private unavailable(err: unknown, what: string): EventStoreUnavailableError {
    return new EventStoreUnavailableError(
      `EventStoreDB at ${this.endpoint} is unreachable (${what}: ${errorText(err)}); check EVENTSTORE_URL and that the server is running`,
      { cause: err },
    );
  }
}
