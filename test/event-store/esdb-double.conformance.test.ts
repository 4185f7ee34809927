import { after, before } from 'node:test';
import { EventStoreDBClient, jsonEvent } from '@eventstore/db-client';
import { EsdbEventStore } from '../../src/adapters/esdb/esdb-event-store.js';
import { FakeEsdbServer } from '../esdb/fake-esdb-server.js';
import { describeEventStoreConformance } from './conformance.js';

/**
 * The EventStoreDB adapter, through the real @eventstore/db-client, against the
 * gRPC test double (test/esdb/fake-esdb-server.ts): runs on every CI run,
 * because no EventStoreDB server can be installed here. The double advertises
 * Streams.BatchAppend like a current server, so appends take the client's
 * BatchAppend path; test/esdb/esdb-faults.test.ts also covers Streams.Append.
 */
let fake: FakeEsdbServer;
before(async () => {
  fake = await FakeEsdbServer.start();
});
after(async () => {
  await fake?.stop();
});

describeEventStoreConformance('esdb (real client → gRPC test double)', async () => {
  const store = new EsdbEventStore({ connectionString: fake.connectionString });
  const raw = EventStoreDBClient.connectionString(fake.connectionString);
  return {
    store,
    async close() {
      await store.close();
      await raw.dispose();
    },
    async appendRaw(streamId, event) {
      // A foreign writer: the bare client, no metadata.
      await raw.appendToStream(streamId, jsonEvent({ id: event.id, type: event.type, data: JSON.parse(event.data) as Record<string, unknown> }));
    },
  };
});
