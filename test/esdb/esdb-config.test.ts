import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { EsdbEventStore } from '../../src/adapters/esdb/esdb-event-store.js';
import { EventStoreUnavailableError } from '../../src/domain/event-store.port.js';

describe('EventStoreDB adapter configuration', () => {
  for (const bad of [
    'esdb://',
    'http://127.0.0.1:2113',
    'esdb://127.0.0.1:2113?tls=maybe',
    'esdb://127.0.0.1:notaport',
    'esdb://127.0.0.1:2113?tsl=false',
    'esdb://127.0.0.1:2113?throwOnAppendFailure=false',
  ]) {
    it(`rejects the connection string ${JSON.stringify(bad)} with a typed error naming EVENTSTORE_URL`, () => {
      assert.throws(
        () => new EsdbEventStore({ connectionString: bad }),
        (err: Error & { code?: string; status?: number }) => {
          assert.equal(err.code, 'INVALID_EVENTSTORE_URL');
          assert.equal(err.status, 400);
          assert.match(err.message, /EVENTSTORE_URL/);
          return true;
        },
      );
    });
  }

  it('a bad connection string with credentials: the error names the problem, not the password', () => {
    for (const bad of [
      'esdb://admin:s3cret-passw0rd@127.0.0.1:abc',
      'esdb://admin:s3cret-passw0rd@127.0.0.1:2113?bogus=1',
      'esdb://admin:s3cret-passw0rd@127.0.0.1:2113?tls=maybe',
    ]) {
      assert.throws(
        () => new EsdbEventStore({ connectionString: bad }),
        (err: Error & { code?: string }) => {
          assert.equal(err.code, 'INVALID_EVENTSTORE_URL');
          assert.doesNotMatch(err.message, /s3cret/);
          return true;
        },
      );
    }
  });

  it('never puts the credentials of the connection string in an error', { timeout: 15_000 }, async () => {
    // Port 1 on loopback: nothing listens there, the connection is refused at once.
    const store = new EsdbEventStore({ connectionString: 'esdb://admin:s3cret-passw0rd@127.0.0.1:1?tls=false', pingTimeoutMs: 3_000 });
    try {
      const err = await store.ping().then(
        () => assert.fail('ping succeeded with no server'),
        (e: unknown) => e,
      );
      assert.ok(err instanceof EventStoreUnavailableError);
      assert.match(err.message, /EventStoreDB at 127\.0\.0\.1:1 is unreachable/);
      assert.doesNotMatch(err.message, /s3cret|admin/);
      assert.doesNotMatch(JSON.stringify(err.details ?? {}), /s3cret/);
    } finally {
      await store.close();
    }
  });
});
