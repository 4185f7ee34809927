import { Subscription } from 'rxjs';
import type { EventStore, Position, RecordedEvent } from '../domain/event-store.port.js';

export interface FeedSink {
  next(event: RecordedEvent): void;
  error(err: unknown): void;
}

/**
 * One live subscription to the whole log, shared by every projection runner
 * of this process on one store (the read models' runner and the webhook
 * outbox's). Each subscription of the store re-reads the log on every wake-up
 * (after each commit, and again on its NOTIFY), so two runners following on
 * their own read every new event twice: on a 2-core machine those reads were
 * a fifth of a create's statements.
 *
 * A sink joins the running subscription when it asks for events after a
 * position the feed has not delivered past yet (it then gets only the events
 * after its own position); one further behind gets a subscription of its own,
 * as before. The upstream ends when its last sink leaves, and an error (or an
 * unexpected end) ends it for every sink (each runner restarts from its
 * checkpoint).
 */
export class LiveFeed {
  private upstream: Subscription | undefined;
  private readonly sinks = new Map<FeedSink, Position | undefined>();
  /** The position of the last event the upstream delivered, or the one it started after. */
  private delivered: Position | undefined;

  private constructor(private readonly store: EventStore) {}

  private static readonly feeds = new WeakMap<EventStore, LiveFeed>();

  static of(store: EventStore): LiveFeed {
    let feed = LiveFeed.feeds.get(store);
    if (!feed) LiveFeed.feeds.set(store, (feed = new LiveFeed(store)));
    return feed;
  }

  /** Every event after `after`, in log order, until the returned subscription is ended. */
  subscribe(after: Position | undefined, sink: FeedSink): Subscription {
    if (this.upstream && !this.canJoin(after)) return this.own(after, sink);
    this.sinks.set(sink, after);
    if (!this.upstream) this.start(after);
    return new Subscription(() => {
      if (this.sinks.delete(sink) && this.sinks.size === 0) this.stop();
    });
  }

  private canJoin(after: Position | undefined): boolean {
    if (this.delivered === undefined) return true; // nothing delivered yet: the upstream starts at the very beginning or `after`
    return after !== undefined && after >= this.delivered;
  }

  private start(after: Position | undefined): void {
    this.delivered = after;
    const ended = { failed: false };
    const end = (err: unknown): void => {
      ended.failed = true;
      const sinks = [...this.sinks.keys()];
      this.sinks.clear();
      this.stop();
      for (const s of sinks) s.error(err);
    };
    const upstream = this.store.subscribeToAll({ after }).subscribe({
      next: (item) => {
        if (item.kind !== 'event') return;
        const e = item.event;
        this.delivered = e.position;
        for (const [sink, from] of this.sinks) if (from === undefined || e.position > from) sink.next(e);
      },
      error: (err: unknown) => end(err),
      // The store's subscriptions do not complete; if one did, its sinks would wait forever: they restart instead.
      complete: () => end(new Error('the live subscription to the log ended')),
    });
    // An error delivered before subscribe() returned has already ended it.
    if (!ended.failed) this.upstream = upstream;
  }

  private stop(): void {
    this.upstream?.unsubscribe();
    this.upstream = undefined;
    this.delivered = undefined;
  }

  private own(after: Position | undefined, sink: FeedSink): Subscription {
    return this.store.subscribeToAll({ after }).subscribe({
      next: (item) => {
        if (item.kind === 'event') sink.next(item.event);
      },
      error: (err: unknown) => sink.error(err),
      complete: () => sink.error(new Error('the live subscription to the log ended')),
    });
  }
}
