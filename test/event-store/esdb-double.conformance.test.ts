import { after, before } from 'node:test';
import { EventStoreDBClient, jsonEvent } from '@eventstore/db-client';
import { EsdbEventStore } from '../../src/adapters/esdb/esdb-event-store.js';
import { FakeEsdbServer } from '../esdb/fake-esdb-server.js';
import { describeEventStoreConformance, type ConformanceTarget } from './conformance.js';

/**
 * The EventStoreDB adapter, through the real @eventstore/db-client, against the
 * gRPC test double (test/esdb/fake-esdb-server.ts): runs on every CI run,
 * because no EventStoreDB server can be installed here. Twice: once with the
 * double advertising Streams.BatchAppend, as a current server does (the
 * client's usual append path), once without it (the client's Streams.Append).
 */
let fake: FakeEsdbServer;
let plain: FakeEsdbServer;
before(async () => {
  fake = await FakeEsdbServer.start();
  plain = await FakeEsdbServer.start({ batchAppend: false });
});
after(async () => {
  await fake?.stop();
  await plain?.stop();
});

describeEventStoreConformance('esdb (real client → gRPC test double, BatchAppend)', () => open(fake));
describeEventStoreConformance('esdb (real client → gRPC test double, Append)', () => open(plain));

function open(fake: FakeEsdbServer): Promise<ConformanceTarget> {
  const store = new EsdbEventStore({ connectionString: fake.connectionString });
  const raw = EventStoreDBClient.connectionString(fake.connectionString);
  return Promise.resolve({
    store,
    async close() {
      await store.close();
      await raw.dispose();
    },
    async appendRaw(streamId, event) {
      // A foreign writer: the bare client, no metadata.
      await raw.appendToStream(
        streamId,
        jsonEvent({ id: event.id, type: event.type, data: JSON.parse(event.data) as Record<string, unknown> }),
      );
    },
  });
}
