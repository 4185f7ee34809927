import { randomUUID } from 'node:crypto';
import type { Aggregate } from '../domain/aggregate.js';
import type { Decider } from '../domain/decider.js';
import {
  ConcurrencyError,
  type EventMetadata,
  type EventStore,
  type ExpectedRevision,
  type Position,
  type RecordedEvent,
} from '../domain/event-store.port.js';

/** Who asked and why: carried into every event's metadata. */
export interface CommandMeta {
  readonly correlationId: string;
  readonly causationId?: string | undefined;
  readonly tenantId?: string | undefined;
  readonly actor: string;
}

export interface DomainEvent {
  readonly type: string;
  readonly data: unknown;
}

export interface Loaded<S> {
  readonly state: S;
  /** Revision of the last event read, or 'no_stream'. */
  readonly revision: bigint | 'no_stream';
}

export interface Handled<S, E> {
  readonly state: S;
  readonly events: readonly E[];
  /** Position of the last event appended, or undefined when the command changed nothing. */
  readonly position: Position | undefined;
  readonly revision: bigint | 'no_stream';
}

export type Clock = () => Date;

export interface HandleOptions {
  readonly expected?: ExpectedRevision;
  /**
   * The caller just minted the stream's id at random: the stream cannot exist, so the decision is made on
   * the initial state without a read, and the append expects no stream (which still catches the impossible).
   */
  readonly newStream?: boolean;
  readonly onConflict?: (err: ConcurrencyError, attempt: number) => boolean;
}

export type BoundOf<A> = A extends Aggregate<infer C, infer E, infer S> ? BoundHandler<C, E, S> : never;

/** A command handler bound to one aggregate: callers name an instance by id, never a stream. */
export interface BoundHandler<C, E, S> {
  load(id: string): Promise<Loaded<S>>;
  handle(id: string, command: C | readonly C[] | ((state: S) => C), meta: CommandMeta, options?: HandleOptions): Promise<Handled<S, E>>;
}

/**
 * Decodes a stored event into a domain event: the stream is the source of
 * truth, so an event that fails its own schema is a bug worth stopping for.
 */
export type EventCodec<E> = (recorded: RecordedEvent) => E | undefined;

/**
 * Load → fold → decide → append at the revision read. On a concurrency
 * conflict the whole cycle reruns (bounded), so the decision is always made
 * on the state it is appended after: this is how host capacity, tenant quota
 * and a VM's lifecycle stay consistent under any number of writers.
 */
export class CommandHandler {
  /**
   * Folded states by stream, so a load reads only the events after the cached
   * revision. Without it every reservation re-read and re-folded the host's
   * whole history (each reservation and release stays in `host-<id>`
   * forever): a create's cost grew with every VM the host had ever run.
   * Stale is safe: the read goes forward from the cached revision, and an
   * append still expects the revision the decision was made on.
   */
  private readonly states = new Map<string, { decider: unknown; state: unknown; revision: bigint }>();

  constructor(
    private readonly store: EventStore,
    private readonly clock: Clock = () => new Date(),
    private readonly maxAttempts = 8,
    private readonly maxCachedStreams = 10_000,
  ) {}

  async load<C, E, S>(streamId: string, decider: Decider<C, E, S>, decode: EventCodec<E>): Promise<Loaded<S>> {
    const cached = this.states.get(streamId);
    const hit = cached !== undefined && cached.decider === decider;
    let state = hit ? (cached.state as S) : decider.initialState;
    let revision: bigint | 'no_stream' = hit ? cached.revision : 'no_stream';
    const recorded = await this.store.readStream(streamId, revision === 'no_stream' ? undefined : { fromRevision: revision + 1n });
    for (const r of recorded) {
      const e = decode(r);
      if (e !== undefined) state = decider.evolve(state, e);
      revision = r.revision;
    }
    this.remember(streamId, decider, state, revision);
    return { state, revision };
  }

  private cached<S>(streamId: string, decider: unknown): Loaded<S> | undefined {
    const c = this.states.get(streamId);
    return c && c.decider === decider ? { state: c.state as S, revision: c.revision } : undefined;
  }

  private remember(streamId: string, decider: unknown, state: unknown, revision: bigint | 'no_stream'): void {
    if (revision === 'no_stream') return;
    const cur = this.states.get(streamId);
    if (cur && cur.decider === decider && cur.revision > revision) return;
    this.states.delete(streamId);
    this.states.set(streamId, { decider, state, revision });
    const oldest = this.states.keys().next();
    if (this.states.size > this.maxCachedStreams && !oldest.done) this.states.delete(oldest.value);
  }

  /**
   * Runs `command` (or a function of the loaded state returning one) against
   * the stream. `onConflict` can veto another attempt (e.g. placement wants to
   * re-decide elsewhere instead). A list of commands is decided one after
   * another, each on the state the previous one's events left, and appended
   * together: one durable append where there would be one per command.
   */
  async handle<C, E extends DomainEvent, S>(
    streamId: string,
    decider: Decider<C, E, S>,
    decode: EventCodec<E>,
    command: C | readonly C[] | ((state: S) => C),
    meta: CommandMeta,
    options: HandleOptions = {},
  ): Promise<Handled<S, E>> {
    // A cached state is tried without a read: a stale one loses the append (expected revision) and is re-read.
    // Only a state just read may answer "nothing to do" or refuse: a stale cache must not decide those.
    let trustCache = options.expected === undefined && !options.newStream;
    for (let attempt = 1; ; attempt++) {
      const cached = trustCache ? this.cached<S>(streamId, decider) : undefined;
      const loaded: Loaded<S> =
        cached ?? (options.newStream ? { state: decider.initialState, revision: 'no_stream' } : await this.load(streamId, decider, decode));
      const cmd = typeof command === 'function' ? (command as (s: S) => C)(loaded.state) : command;
      const now = this.clock();
      let events: readonly E[];
      try {
        if (Array.isArray(cmd)) {
          const all: E[] = [];
          let st = loaded.state;
          for (const c of cmd as readonly C[]) {
            for (const e of decider.decide(c, st, { now }).map(withoutNul)) {
              all.push(e);
              st = decider.evolve(st, e);
            }
          }
          events = all;
        } else events = decider.decide(cmd as C, loaded.state, { now }).map(withoutNul);
      } catch (err) {
        if (!cached) throw err;
        trustCache = false;
        attempt--;
        continue;
      }
      if (events.length === 0) {
        if (!cached) return { state: loaded.state, events, position: undefined, revision: loaded.revision };
        trustCache = false;
        attempt--;
        continue;
      }
      // An event that does not read back through its own schema is never stored: once in the log it
      // would stop every projection at it, on every replica, until someone hand-edits history.
      for (const e of events)
        decode({ id: '', streamId, type: e.type, revision: 0n, position: '', data: e.data as never, metadata: {}, created: now });
      try {
        const result = await this.store.append(
          streamId,
          events.map((e) => ({ id: randomUUID(), type: e.type, data: e.data, metadata: metadataFor(meta, now) })),
          options.newStream ? 'no_stream' : (options.expected ?? loaded.revision),
        );
        let state = loaded.state;
        for (const e of events) state = decider.evolve(state, e);
        this.remember(streamId, decider, state, result.nextExpectedRevision);
        return { state, events, position: result.position, revision: result.nextExpectedRevision };
      } catch (err) {
        trustCache = false;
        if (cached && err instanceof ConcurrencyError) {
          // Our cache was behind, not a race: re-read without counting an attempt or asking onConflict.
          attempt--;
          continue;
        }
        if (!(err instanceof ConcurrencyError) || attempt >= this.maxAttempts || options.newStream) throw err;
        if (options.onConflict && !options.onConflict(err, attempt)) throw err;
        await jitter(attempt);
      }
    }
  }
}

export function metadataFor(meta: CommandMeta, now: Date): EventMetadata {
  return {
    correlationId: meta.correlationId,
    causationId: meta.causationId,
    tenantId: meta.tenantId,
    actor: meta.actor,
    recordedAt: now.toISOString(),
  };
}

/**
 * Postgres text and jsonb refuse U+0000, so an event string carrying one (an agent's output quoted in a
 * failure message) would stop every read model that copies it: it is stored as U+FFFD instead.
 */
function withoutNul<T>(value: T): T {
  if (typeof value === 'string') return (value.includes('\0') ? value.replaceAll('\0', '\uFFFD') : value) as T;
  if (value === null || typeof value !== 'object') return value;
  if (Array.isArray(value)) {
    const out = value.map(withoutNul);
    return (out.some((v, i) => v !== value[i]) ? out : value) as T;
  }
  let changed = false;
  const out: Record<string, unknown> = {};
  for (const [k, v] of Object.entries(value)) {
    const key = withoutNul(k);
    const clean: unknown = withoutNul(v as unknown);
    if (key !== k || clean !== v) changed = true;
    out[key] = clean;
  }
  return (changed ? out : value) as T;
}

/** Spreads retries of writers that collided so they do not collide again in lockstep. */
function jitter(attempt: number): Promise<void> {
  const ms = Math.random() * Math.min(50, 2 ** attempt);
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/**
 * The handler for one aggregate (emmett's `CommandHandler({ evolve, initialState })`):
 * its streams, decoder and decider in one place, bound once; callers name an instance by id.
 */
export function bindAggregate<C, E extends DomainEvent, S>(handler: CommandHandler, aggregate: Aggregate<C, E, S>): BoundHandler<C, E, S> {
  return {
    load: (id) => handler.load(aggregate.streamName(id), aggregate.decider, aggregate.decode),
    handle: (id, command, meta, options) =>
      handler.handle(aggregate.streamName(id), aggregate.decider, aggregate.decode, command, meta, options),
  };
}
