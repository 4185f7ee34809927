import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { createSnapshotRequestSchema } from '../../src/commands/snapshot/snapshot-commands.js';

/** A snapshot request's expiry is refused up front when Postgres could not store it: recorded, it would stop the snapshots read model. */
describe('snapshot request: retention bounds', () => {
  const paths = (input: unknown): string[] => {
    const r = createSnapshotRequestSchema.safeParse(input);
    return r.success ? [] : r.error.issues.map((i) => i.path.join('.'));
  };

  it('refuses a retention_until outside years 1..9999 and a retention_s beyond 100 years', () => {
    assert.deepEqual(paths({ retention_until: '0000-01-01T00:00:00Z' }), ['retention_until']);
    assert.deepEqual(paths({ retention_until: '9999-12-31T23:59:59-14:00' }), ['retention_until']);
    assert.deepEqual(paths({ retention_s: 1e12 }), ['retention_s']);
  });

  it('takes the ordinary ones', () => {
    assert.deepEqual(paths({ retention_until: '2030-01-01T00:00:00Z' }), []);
    assert.deepEqual(paths({ retention_until: '9999-12-31T00:00:00+02:00' }), []);
    assert.deepEqual(paths({ retention_s: 3600 }), []);
    assert.deepEqual(paths({}), []);
  });
});
