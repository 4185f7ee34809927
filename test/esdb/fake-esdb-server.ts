/**
 * TEST DOUBLE of EventStoreDB's gRPC client protocol — not EventStoreDB.
 *
 * Why it exists: no EventStoreDB server can be installed on the machines this
 * project builds and tests on (it is in neither npm nor Debian), yet an adapter
 * that never runs is broken without anyone knowing. So CI runs the adapter,
 * through the real `@eventstore/db-client`, against this in-process gRPC server.
 * It speaks the client's own wire messages: the service definitions and
 * message classes come from the client package (`generated/*_pb`), served with
 * the same `@grpc/grpc-js` the client uses.
 *
 * It implements only what the adapter uses (docs/eventstoredb.md lists what it
 * does and does not cover):
 * - ServerFeatures.GetSupportedMethods (the client asks it once per channel to
 *   choose between Streams.BatchAppend and Streams.Append);
 * - Streams.Append and Streams.BatchAppend: expected-revision checks, EventStoreDB's
 *   idempotency rules, the wrong-expected-version shapes of each;
 * - Streams.Read of one stream and of `$all`, forwards/backwards, from a
 *   revision/position/start/end, with a count; stream-not-found;
 * - subscriptions to `$all` from start/end/position with stream-name or
 *   event-type filters (prefixes or regex), checkpoints every
 *   `checkpointIntervalMultiplier × window` scanned events, the CaughtUp
 *   message (in this client's proto since 23.10) and live delivery;
 * - fault injection for tests: `dropSubscriptions()`, `stop()` / `start()` on
 *   the same port (the log survives, like a server's disk).
 * Data lives in memory; there is no auth, TLS, cluster, deletion, stream
 * metadata/ACLs, projections or persistent subscriptions.
 */
import { randomUUID } from 'node:crypto';
import { createRequire } from 'node:module';
import * as grpc from '@grpc/grpc-js';
import streamsPb from '@eventstore/db-client/generated/streams_pb.js';
import streamsGrpc from '@eventstore/db-client/generated/streams_grpc_pb.js';
import sharedPb from '@eventstore/db-client/generated/shared_pb.js';
import statusPb from '@eventstore/db-client/generated/status_pb.js';
import featuresPb from '@eventstore/db-client/generated/serverfeatures_pb.js';
import featuresGrpc from '@eventstore/db-client/generated/serverfeatures_grpc_pb.js';
import type { AppendReq, BatchAppendReq, BatchAppendResp, ReadReq, ReadResp } from '@eventstore/db-client/generated/streams_pb.js';
import type { StreamIdentifier, UUID } from '@eventstore/db-client/generated/shared_pb.js';
import type { Any } from 'google-protobuf/google/protobuf/any_pb.js';
import type { Empty as GoogleEmpty } from 'google-protobuf/google/protobuf/empty_pb.js';

// google-protobuf must be the very instance the generated code loads (its
// serializers check `instanceof`), so resolve it from the client's folder.
const clientRequire = createRequire(createRequire(import.meta.url).resolve('@eventstore/db-client/generated/status_pb.js'));
const { Any: AnyMessage } = clientRequire('google-protobuf/google/protobuf/any_pb.js') as { Any: new () => Any };
const { Empty: GoogleEmptyMessage } = clientRequire('google-protobuf/google/protobuf/empty_pb.js') as { Empty: new () => GoogleEmpty };

const {
  ReadResp: ReadRespMessage,
  AppendResp: AppendRespMessage,
  BatchAppendResp: BatchAppendRespMessage,
  ReadReq: ReadReqMessage,
} = streamsPb;

/** "created" travels as 100-ns ticks since the Unix epoch (the client divides by 10,000 to get ms). */
const TICKS_PER_MS = 10_000n;
/** EventStoreDB's default search window for a `count` filter window: checkpoints come every multiplier × 32 events (EventStore/EventStore PR #2608). */
const DEFAULT_WINDOW = 32;
const SERVER_VERSION = '24.10.0-test-double';

export interface StoredEvent {
  readonly stream: string;
  readonly revision: bigint;
  readonly id: string;
  readonly type: string;
  readonly contentType: string;
  readonly data: Uint8Array;
  readonly metadata: Uint8Array;
  readonly created: bigint;
  /** Transaction-log byte offsets. Each event here is its own committed record, so commit == prepare. */
  readonly commit: bigint;
  readonly prepare: bigint;
}

type Expected = { kind: 'any' } | { kind: 'no_stream' } | { kind: 'stream_exists' } | { kind: 'revision'; revision: bigint };

type AppendOutcome =
  { ok: true; revision: bigint; commit: bigint; prepare: bigint } | { ok: false; current: bigint | 'no_stream'; expected: Expected };

interface Proposed {
  id: string;
  type: string;
  contentType: string;
  data: Uint8Array;
  metadata: Uint8Array;
}

interface EventFilter {
  on: 'stream' | 'type';
  prefixes: string[];
  regex: RegExp | undefined;
}

interface LiveSubscription {
  call: grpc.ServerWritableStream<ReadReq, ReadResp>;
  next: number; // index into the log of the next event to scan
  filter: EventFilter | undefined;
  checkpointEvery: number;
  scanned: number;
  caughtUp: boolean;
}

export interface FakeEsdbOptions {
  /** 0 (default) picks a free port. */
  readonly port?: number;
  /** Advertise Streams.BatchAppend (as servers ≥ 21.10 do); false makes the client use Streams.Append. */
  readonly batchAppend?: boolean;
}

export class FakeEsdbServer {
  private server: grpc.Server | undefined;
  private boundPort = 0;
  private readonly log: StoredEvent[] = [];
  private readonly streams = new Map<string, StoredEvent[]>();
  private readonly subscriptions = new Set<LiveSubscription>();
  private nextOffset = 0n;
  private readonly batchAppend: boolean;
  /** Where each `$all` subscription started (`start`, `end` or after a position): lets tests see resubscriptions. */
  readonly subscriptionStarts: Array<'start' | 'end' | { commit: bigint; prepare: bigint }> = [];
  /** Calls per gRPC method, e.g. `Streams.BatchAppend`: lets tests see which path the client took. */
  readonly calls = new Map<string, number>();

  private constructor(options: FakeEsdbOptions) {
    this.boundPort = options.port ?? 0;
    this.batchAppend = options.batchAppend ?? true;
    // A fresh EventStoreDB node writes system records before any user event
    // (e.g. `$epoch-information` in `$epochs`); seeding one here keeps the
    // adapter's "system events are excluded" rule under test.
    this.write('$epochs', [
      {
        id: randomUUID(),
        type: '$epoch-information',
        contentType: 'application/json',
        data: Buffer.from('{"epochNumber":0}'),
        metadata: new Uint8Array(),
      },
    ]);
  }

  /** Creates the double and starts it on 127.0.0.1 (ephemeral port unless `options.port`). */
  static async start(options: FakeEsdbOptions = {}): Promise<FakeEsdbServer> {
    const fake = new FakeEsdbServer(options);
    await fake.start();
    return fake;
  }

  /** Creates the double without listening: for "server down at start-up" tests. */
  static create(options: FakeEsdbOptions & { port: number }): FakeEsdbServer {
    return new FakeEsdbServer(options);
  }

  get port(): number {
    return this.boundPort;
  }

  get connectionString(): string {
    return `esdb://127.0.0.1:${this.boundPort}?tls=false`;
  }

  get running(): boolean {
    return this.server !== undefined;
  }

  /** Every event in the log, system ones included: lets tests assert on what was really stored. */
  get events(): readonly StoredEvent[] {
    return this.log;
  }

  get liveSubscriptionCount(): number {
    return this.subscriptions.size;
  }

  /** Listens again (on the same port after a `stop()`); the log is kept. */
  async start(): Promise<void> {
    if (this.server) return;
    const server = new grpc.Server();
    server.addService(streamsGrpc.StreamsService, {
      read: (call: grpc.ServerWritableStream<ReadReq, ReadResp>) => this.count('Streams.Read') && this.onRead(call),
      append: (call: grpc.ServerReadableStream<AppendReq, unknown>, callback: grpc.sendUnaryData<unknown>) =>
        this.count('Streams.Append') && this.onAppend(call, callback),
      batchAppend: (call: grpc.ServerDuplexStream<BatchAppendReq, BatchAppendResp>) =>
        this.count('Streams.BatchAppend') && this.onBatchAppend(call),
      delete: (_call: unknown, callback: grpc.sendUnaryData<unknown>) => callback(unimplemented('Streams.Delete')),
      tombstone: (_call: unknown, callback: grpc.sendUnaryData<unknown>) => callback(unimplemented('Streams.Tombstone')),
    });
    server.addService(featuresGrpc.ServerFeaturesService, {
      getSupportedMethods: (_call: unknown, callback: grpc.sendUnaryData<unknown>) =>
        this.count('ServerFeatures.GetSupportedMethods') && callback(null, this.supportedMethods()),
    });
    this.boundPort = await new Promise<number>((resolve, reject) =>
      server.bindAsync(`127.0.0.1:${this.boundPort}`, grpc.ServerCredentials.createInsecure(), (err, port) =>
        err ? reject(err) : resolve(port),
      ),
    );
    this.server = server;
  }

  /** Stops listening and cuts every open call, as a crashed or restarted node would. */
  stop(): Promise<void> {
    const server = this.server;
    if (!server) return Promise.resolve();
    this.server = undefined;
    this.subscriptions.clear();
    server.forceShutdown();
    return Promise.resolve();
  }

  /**
   * Ends every live `$all` subscription with UNAVAILABLE, as a node does when
   * it drops subscribers (restart, leader change, slow consumer).
   */
  dropSubscriptions(): number {
    const dropped = [...this.subscriptions];
    this.subscriptions.clear();
    for (const sub of dropped) {
      sub.call.emit('error', { code: grpc.status.UNAVAILABLE, details: 'subscription dropped by the EventStoreDB test double' });
    }
    return dropped.length;
  }

  private count(method: string): true {
    this.calls.set(method, (this.calls.get(method) ?? 0) + 1);
    return true;
  }

  // ------------------------------------------------------------ features

  private supportedMethods(): InstanceType<typeof featuresPb.SupportedMethods> {
    const out = new featuresPb.SupportedMethods();
    out.setEventStoreServerVersion(SERVER_VERSION);
    const methods: Array<[string, string]> = [
      ['event_store.client.streams.streams', 'read'],
      ['event_store.client.streams.streams', 'append'],
      ['event_store.client.server_features.serverfeatures', 'getsupportedmethods'],
    ];
    if (this.batchAppend) methods.push(['event_store.client.streams.streams', 'batchappend']);
    out.setMethodsList(
      methods.map(([service, method]) => {
        const m = new featuresPb.SupportedMethod();
        m.setServiceName(service);
        m.setMethodName(method);
        return m;
      }),
    );
    return out;
  }

  // ------------------------------------------------------------ append

  private onAppend(call: grpc.ServerReadableStream<AppendReq, unknown>, callback: grpc.sendUnaryData<unknown>): void {
    let stream: string | undefined;
    let expected: Expected | undefined;
    const proposed: Proposed[] = [];
    call.on('data', (req: AppendReq) => {
      const options = req.getOptions();
      if (options) {
        stream = streamName(options.getStreamIdentifier());
        const Case = streamsPb.AppendReq.Options.ExpectedStreamRevisionCase;
        switch (options.getExpectedStreamRevisionCase()) {
          case Case.REVISION:
            expected = { kind: 'revision', revision: BigInt(options.getRevision()) };
            break;
          case Case.NO_STREAM:
            expected = { kind: 'no_stream' };
            break;
          case Case.STREAM_EXISTS:
            expected = { kind: 'stream_exists' };
            break;
          default:
            expected = { kind: 'any' };
        }
      }
      const message = req.getProposedMessage();
      if (message) proposed.push(toProposed(message));
    });
    call.on('error', () => undefined);
    call.on('end', () => {
      if (stream === undefined || expected === undefined) {
        callback({ code: grpc.status.INVALID_ARGUMENT, details: 'append without options' });
        return;
      }
      const outcome = this.appendChecked(stream, expected, proposed);
      const resp = new AppendRespMessage();
      if (outcome.ok) {
        const success = new streamsPb.AppendResp.Success();
        success.setCurrentRevision(outcome.revision.toString());
        const position = new streamsPb.AppendResp.Position();
        position.setCommitPosition(outcome.commit.toString());
        position.setPreparePosition(outcome.prepare.toString());
        success.setPosition(position);
        resp.setSuccess(success);
      } else {
        const wev = new streamsPb.AppendResp.WrongExpectedVersion();
        if (outcome.current === 'no_stream') wev.setCurrentNoStream(new sharedPb.Empty());
        else wev.setCurrentRevision(outcome.current.toString());
        switch (outcome.expected.kind) {
          case 'revision':
            wev.setExpectedRevision(outcome.expected.revision.toString());
            break;
          case 'no_stream':
            wev.setExpectedNoStream(new sharedPb.Empty());
            break;
          case 'stream_exists':
            wev.setExpectedStreamExists(new sharedPb.Empty());
            break;
          case 'any':
            wev.setExpectedAny(new sharedPb.Empty());
        }
        resp.setWrongExpectedVersion(wev);
      }
      callback(null, resp);
    });
  }

  /**
   * BatchAppend is one long-lived duplex stream per client; each append is a
   * correlation id whose messages may span several requests, ending with
   * `is_final`. A conflict answers with a google.rpc.Status whose details pack
   * `event_store.client.WrongExpectedVersion` (what the client unpacks).
   */
  private onBatchAppend(call: grpc.ServerDuplexStream<BatchAppendReq, BatchAppendResp>): void {
    const pending = new Map<string, { stream: string; expected: Expected; proposed: Proposed[]; correlation: UUID }>();
    call.on('error', () => undefined);
    call.on('end', () => call.end());
    call.on('data', (req: BatchAppendReq) => {
      const correlation = req.getCorrelationId();
      if (!correlation) return;
      const key = uuidString(correlation);
      let entry = pending.get(key);
      const options = req.getOptions();
      if (!entry) {
        if (!options) return;
        const Case = streamsPb.BatchAppendReq.Options.ExpectedStreamPositionCase;
        let expected: Expected;
        switch (options.getExpectedStreamPositionCase()) {
          case Case.STREAM_POSITION:
            expected = { kind: 'revision', revision: BigInt(options.getStreamPosition()) };
            break;
          case Case.NO_STREAM:
            expected = { kind: 'no_stream' };
            break;
          case Case.STREAM_EXISTS:
            expected = { kind: 'stream_exists' };
            break;
          default:
            expected = { kind: 'any' };
        }
        entry = { stream: streamName(options.getStreamIdentifier()), expected, proposed: [], correlation };
        pending.set(key, entry);
      }
      for (const message of req.getProposedMessagesList()) entry.proposed.push(toProposed(message));
      if (!req.getIsFinal()) return;
      pending.delete(key);
      const outcome = this.appendChecked(entry.stream, entry.expected, entry.proposed);
      const resp = new BatchAppendRespMessage();
      resp.setCorrelationId(entry.correlation);
      resp.setStreamIdentifier(streamIdentifier(entry.stream));
      setBatchExpected(resp, entry.expected);
      if (outcome.ok) {
        const success = new streamsPb.BatchAppendResp.Success();
        success.setCurrentRevision(outcome.revision.toString());
        const position = new sharedPb.AllStreamPosition();
        position.setCommitPosition(outcome.commit.toString());
        position.setPreparePosition(outcome.prepare.toString());
        success.setPosition(position);
        resp.setSuccess(success);
      } else {
        const details = new sharedPb.WrongExpectedVersion();
        if (outcome.current === 'no_stream') details.setCurrentNoStream(new GoogleEmptyMessage());
        else details.setCurrentStreamRevision(outcome.current.toString());
        switch (outcome.expected.kind) {
          case 'revision':
            details.setExpectedStreamPosition(outcome.expected.revision.toString());
            break;
          case 'no_stream':
            details.setExpectedNoStream(new GoogleEmptyMessage());
            break;
          case 'stream_exists':
            details.setExpectedStreamExists(new GoogleEmptyMessage());
            break;
          case 'any':
            details.setExpectedAny(new GoogleEmptyMessage());
        }
        const any = new AnyMessage();
        any.pack(details.serializeBinary(), 'event_store.client.WrongExpectedVersion');
        const status = new statusPb.Status();
        // eslint-disable-next-line @typescript-eslint/no-unsafe-enum-assignment -- FAILED_PRECONDITION by number: the generated Code enum is not exported
        status.setCode(9);
        status.setMessage(`WrongExpectedVersion: stream ${entry.stream}`);
        status.setDetails(any);
        resp.setError(status);
      }
      call.write(resp);
    });
  }

  /**
   * Expected-revision and idempotency rules as EventStoreDB documents them
   * ("Optimistic concurrency and idempotence", EventStore/documentation,
   * clients/dotnet/21.2/appending): with an expected revision below the
   * current one, a batch whose ids are exactly the events that follow it is
   * acknowledged without writing; none or only some of them → wrong expected
   * version. With `any` (and `stream_exists` on an existing stream) the same
   * id check runs from the batch's first id. An idempotent ack reports the
   * revision and position of the last matching event already stored.
   */
  private appendChecked(stream: string, expected: Expected, proposed: Proposed[]): AppendOutcome {
    const existing = this.streams.get(stream) ?? [];
    const current: bigint | 'no_stream' = existing.length === 0 ? 'no_stream' : BigInt(existing.length - 1);
    const currentNum = existing.length - 1; // -1 for no stream, as EventStoreDB counts
    const conflict = (): AppendOutcome => ({ ok: false, current, expected });
    const idempotentFrom = (start: number): AppendOutcome | 'none' | 'partial' => {
      let matched = 0;
      for (let i = 0; i < proposed.length; i++) {
        const stored = existing[start + i];
        if (!stored || stored.id !== proposed[i]!.id) break;
        matched++;
      }
      if (matched === 0) return 'none';
      if (matched < proposed.length) return 'partial';
      const last = existing[start + proposed.length - 1]!;
      return { ok: true, revision: last.revision, commit: last.commit, prepare: last.prepare };
    };

    let expectedNum: number;
    switch (expected.kind) {
      case 'any':
      case 'stream_exists': {
        if (expected.kind === 'stream_exists' && existing.length === 0) return conflict();
        const first = existing.findIndex((e) => e.id === proposed[0]?.id);
        if (first >= 0) {
          const check = idempotentFrom(first);
          if (typeof check === 'object') return check;
          if (check === 'partial') return conflict();
        }
        return this.write(stream, proposed);
      }
      case 'no_stream':
        expectedNum = -1;
        break;
      case 'revision':
        expectedNum = Number(expected.revision);
    }
    if (expectedNum === currentNum) return this.write(stream, proposed);
    if (expectedNum > currentNum) return conflict();
    const check = idempotentFrom(expectedNum + 1);
    return typeof check === 'object' ? check : conflict();
  }

  private write(stream: string, proposed: readonly Proposed[]): AppendOutcome & { ok: true } {
    let events = this.streams.get(stream);
    if (!events) {
      events = [];
      this.streams.set(stream, events);
    }
    const created = BigInt(Date.now()) * TICKS_PER_MS;
    let last: StoredEvent | undefined;
    for (const p of proposed) {
      const offset = this.nextOffset;
      // Positions are byte offsets in the transaction log, so they grow by the record's size, not by one.
      this.nextOffset += BigInt(64 + stream.length + p.type.length + p.data.length + p.metadata.length);
      last = { stream, revision: BigInt(events.length), ...p, created, commit: offset, prepare: offset };
      events.push(last);
      this.log.push(last);
    }
    for (const sub of this.subscriptions) this.pump(sub);
    return { ok: true, revision: last!.revision, commit: last!.commit, prepare: last!.prepare };
  }

  // ------------------------------------------------------------ read

  private onRead(call: grpc.ServerWritableStream<ReadReq, ReadResp>): void {
    call.on('error', () => undefined);
    const options = call.request.getOptions();
    if (!options) {
      call.emit('error', { code: grpc.status.INVALID_ARGUMENT, details: 'read without options' });
      return;
    }
    let filter: EventFilter | undefined;
    let checkpointEvery = 0;
    if (options.hasFilter()) {
      const f = options.getFilter()!;
      const expression = f.hasStreamIdentifier() ? f.getStreamIdentifier()! : f.getEventType()!;
      const regex = expression.getRegex();
      filter = {
        on: f.hasStreamIdentifier() ? 'stream' : 'type',
        prefixes: expression.getPrefixList(),
        regex: regex ? new RegExp(regex) : undefined,
      };
      const window = f.hasMax() ? f.getMax() : DEFAULT_WINDOW;
      checkpointEvery = Math.max(1, f.getCheckpointintervalmultiplier()) * window;
    }
    const uuidAsString = options.getUuidOption()?.hasString() ?? true;
    const forwards = options.getReadDirection() === ReadReqMessage.Options.ReadDirection.FORWARDS;

    if (options.hasSubscription()) {
      if (!options.hasAll()) {
        call.emit('error', { code: grpc.status.UNIMPLEMENTED, details: 'the test double subscribes to $all only' });
        return;
      }
      this.subscribeAll(call, options.getAll()!, filter, checkpointEvery);
      return;
    }

    const count = options.hasCount() ? Number(BigInt(options.getCount())) : Number.MAX_SAFE_INTEGER;
    let selected: StoredEvent[];
    if (options.hasStream()) {
      const streamOptions = options.getStream()!;
      const name = streamName(streamOptions.getStreamIdentifier());
      const events = this.streams.get(name);
      if (!events || events.length === 0) {
        const resp = new ReadRespMessage();
        const notFound = new streamsPb.ReadResp.StreamNotFound();
        notFound.setStreamIdentifier(streamIdentifier(name));
        resp.setStreamNotFound(notFound);
        call.write(resp);
        call.end();
        return;
      }
      if (forwards) {
        const from = streamOptions.hasRevision() ? Number(BigInt(streamOptions.getRevision())) : streamOptions.hasEnd() ? events.length : 0;
        selected = events.slice(from, from + count);
      } else {
        const from = streamOptions.hasRevision()
          ? Math.min(Number(BigInt(streamOptions.getRevision())), events.length - 1)
          : streamOptions.hasStart()
            ? -1
            : events.length - 1;
        selected = [];
        for (let i = from; i >= 0 && selected.length < count; i--) selected.push(events[i]!);
      }
    } else {
      const all = options.getAll()!;
      // Reading $all from a position includes the event at it forwards and stops before it backwards.
      selected = [];
      if (forwards) {
        let i = all.hasPosition() ? this.indexAtOrAfter(positionOf(all.getPosition()!)) : all.hasEnd() ? this.log.length : 0;
        for (; i < this.log.length && selected.length < count; i++) {
          if (matches(filter, this.log[i]!)) selected.push(this.log[i]!);
        }
      } else {
        let i = all.hasPosition() ? this.indexAtOrAfter(positionOf(all.getPosition()!)) - 1 : all.hasStart() ? -1 : this.log.length - 1;
        for (; i >= 0 && selected.length < count; i--) {
          if (matches(filter, this.log[i]!)) selected.push(this.log[i]!);
        }
      }
    }
    for (const event of selected) call.write(eventResp(event, uuidAsString));
    call.end();
  }

  private subscribeAll(
    call: grpc.ServerWritableStream<ReadReq, ReadResp>,
    all: ReadReq.Options.AllOptions,
    filter: EventFilter | undefined,
    checkpointEvery: number,
  ): void {
    // A subscription from a position starts after it (exclusive), unlike a read.
    const next = all.hasPosition() ? this.indexAfter(positionOf(all.getPosition()!)) : all.hasEnd() ? this.log.length : 0;
    this.subscriptionStarts.push(all.hasPosition() ? positionOf(all.getPosition()!) : all.hasEnd() ? 'end' : 'start');
    const sub: LiveSubscription = { call, next, filter, checkpointEvery, scanned: 0, caughtUp: false };
    const confirmation = new ReadRespMessage();
    const c = new streamsPb.ReadResp.SubscriptionConfirmation();
    c.setSubscriptionId(randomUUID());
    confirmation.setConfirmation(c);
    call.write(confirmation);
    this.subscriptions.add(sub);
    call.on('cancelled', () => this.subscriptions.delete(sub));
    call.on('close', () => this.subscriptions.delete(sub));
    this.pump(sub);
  }

  /** Sends what the subscriber has not seen yet; the first time it reaches the end of the log, CaughtUp. */
  private pump(sub: LiveSubscription): void {
    if (sub.call.cancelled || sub.call.destroyed) {
      this.subscriptions.delete(sub);
      return;
    }
    while (sub.next < this.log.length) {
      const event = this.log[sub.next++]!;
      if (matches(sub.filter, event)) sub.call.write(eventResp(event, true));
      if (sub.filter) {
        sub.scanned++;
        if (sub.scanned % sub.checkpointEvery === 0) {
          // The position of the last event scanned: resuming after it loses nothing.
          const resp = new ReadRespMessage();
          const checkpoint = new streamsPb.ReadResp.Checkpoint();
          checkpoint.setCommitPosition(event.commit.toString());
          checkpoint.setPreparePosition(event.prepare.toString());
          resp.setCheckpoint(checkpoint);
          sub.call.write(resp);
        }
      }
    }
    if (!sub.caughtUp) {
      sub.caughtUp = true;
      const resp = new ReadRespMessage();
      resp.setCaughtUp(new streamsPb.ReadResp.CaughtUp());
      sub.call.write(resp);
    }
  }

  private indexAtOrAfter(pos: { commit: bigint; prepare: bigint }): number {
    const i = this.log.findIndex((e) => e.commit > pos.commit || (e.commit === pos.commit && e.prepare >= pos.prepare));
    return i < 0 ? this.log.length : i;
  }

  private indexAfter(pos: { commit: bigint; prepare: bigint }): number {
    const i = this.log.findIndex((e) => e.commit > pos.commit || (e.commit === pos.commit && e.prepare > pos.prepare));
    return i < 0 ? this.log.length : i;
  }
}

// ------------------------------------------------------------ helpers

function unimplemented(what: string): grpc.ServiceError {
  return Object.assign(new Error(`${what} is not implemented by the test double`), {
    code: grpc.status.UNIMPLEMENTED,
    details: `${what} is not implemented by the test double`,
    metadata: new grpc.Metadata(),
  });
}

function streamName(identifier: StreamIdentifier | undefined): string {
  return Buffer.from(identifier?.getStreamName_asU8() ?? new Uint8Array()).toString('utf8');
}

function streamIdentifier(name: string): StreamIdentifier {
  const id = new sharedPb.StreamIdentifier();
  id.setStreamName(Buffer.from(name, 'utf8'));
  return id;
}

function uuidString(uuid: UUID): string {
  if (uuid.hasString()) return uuid.getString().toLowerCase();
  const s = uuid.getStructured()!;
  const hex = (v: string) => BigInt.asUintN(64, BigInt(v)).toString(16).padStart(16, '0');
  const h = hex(s.getMostSignificantBits()) + hex(s.getLeastSignificantBits());
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
}

function toProposed(message: AppendReq.ProposedMessage | BatchAppendReq.ProposedMessage): Proposed {
  const metadata = message.getMetadataMap();
  return {
    id: uuidString(message.getId()!),
    type: metadata.get('type') ?? '',
    contentType: metadata.get('content-type') ?? 'application/octet-stream',
    data: message.getData_asU8(),
    metadata: message.getCustomMetadata_asU8(),
  };
}

function setBatchExpected(resp: BatchAppendResp, expected: Expected): void {
  switch (expected.kind) {
    case 'revision':
      resp.setStreamPosition(expected.revision.toString());
      break;
    case 'no_stream':
      resp.setNoStream(new GoogleEmptyMessage());
      break;
    case 'stream_exists':
      resp.setStreamExists(new GoogleEmptyMessage());
      break;
    case 'any':
      resp.setAny(new GoogleEmptyMessage());
  }
}

function positionOf(p: ReadReq.Options.Position): { commit: bigint; prepare: bigint } {
  return { commit: BigInt(p.getCommitPosition()), prepare: BigInt(p.getPreparePosition()) };
}

function matches(filter: EventFilter | undefined, event: StoredEvent): boolean {
  if (!filter) return true;
  const subject = filter.on === 'stream' ? event.stream : event.type;
  if (filter.regex) return filter.regex.test(subject);
  return filter.prefixes.some((p) => subject.startsWith(p));
}

function eventResp(event: StoredEvent, uuidAsString: boolean): ReadResp {
  const recorded = new streamsPb.ReadResp.ReadEvent.RecordedEvent();
  const id = new sharedPb.UUID();
  if (uuidAsString) id.setString(event.id);
  else {
    const hex = event.id.replace(/-/g, '');
    const structured = new sharedPb.UUID.Structured();
    structured.setMostSignificantBits(BigInt.asIntN(64, BigInt(`0x${hex.slice(0, 16)}`)).toString());
    structured.setLeastSignificantBits(BigInt.asIntN(64, BigInt(`0x${hex.slice(16)}`)).toString());
    id.setStructured(structured);
  }
  recorded.setId(id);
  recorded.setStreamIdentifier(streamIdentifier(event.stream));
  recorded.setStreamRevision(event.revision.toString());
  recorded.setCommitPosition(event.commit.toString());
  recorded.setPreparePosition(event.prepare.toString());
  const metadata = recorded.getMetadataMap();
  metadata.set('type', event.type);
  metadata.set('content-type', event.contentType);
  metadata.set('created', event.created.toString());
  recorded.setData(event.data);
  recorded.setCustomMetadata(event.metadata);
  const readEvent = new streamsPb.ReadResp.ReadEvent();
  readEvent.setEvent(recorded);
  readEvent.setCommitPosition(event.commit.toString());
  const resp = new ReadRespMessage();
  resp.setEvent(readEvent);
  return resp;
}
