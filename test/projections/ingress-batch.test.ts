import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { runMigrations } from '../../src/adapters/postgres/migrations.js';
import type { RecordedEvent } from '../../src/domain/event-store.port.js';
import { ingressProjection } from '../../src/projections/ingress/ingress.projection.js';
import { createTestDatabase, type TestDatabase } from '../support/postgres.js';

/**
 * The ingress read model collects a run's deletes into one statement: the
 * rows must be those one event at a time gives, also when a VM's row is
 * written again after a delete in the same run (the deletes must go first),
 * and a second pass over the same run changes nothing.
 */
describe('ingress read model: a run at once equals one event at a time', { timeout: 60_000 }, () => {
  let db: TestDatabase;
  before(async () => {
    db = await createTestDatabase('ingressbatch');
    await runMigrations(db.pool, ingressProjection.migrations);
  });
  after(async () => {
    await db?.drop();
  });

  const at = (s: number): string => new Date(Date.UTC(2026, 11, 3, 10, 0, s)).toISOString();
  const route = (target: string) => [{ as: 'web', port: 8080, public: false, target }];
  let seq = 0;
  const ev = (vm: string, revision: number, type: string, data: Record<string, unknown>): RecordedEvent => {
    seq++;
    return {
      id: `e${seq}`,
      streamId: `vm-${vm}`,
      revision: BigInt(revision),
      position: `0000000000000001-${seq.toString(16).padStart(16, '0')}`,
      type,
      data: data as never,
      metadata: {},
      created: new Date(Date.UTC(2026, 11, 3, 10, 0, seq)),
    };
  };
  const published = (vm: string, revision: number, target: string): RecordedEvent =>
    ev(vm, revision, 'IngressPublished', {
      vm_id: vm,
      tenant_id: 'acme',
      host_id: 'h1',
      routes: route(target),
      token_sha256: 'a'.repeat(64),
      token_encrypted: 'v1.sealed',
      at: at(seq),
    });
  const history = (): RecordedEvent[] => [
    published('va', 1, 'http://127.0.0.1:1'),
    published('vb', 1, 'http://127.0.0.1:2'),
    ev('va', 2, 'VmDestroyRequested', { vm_id: 'va', reason: 'client', at: at(3) }),
    published('va', 3, 'http://127.0.0.1:3'),
    ev('vb', 2, 'IngressUnpublished', { vm_id: 'vb', at: at(5) }),
    published('vc', 1, 'http://127.0.0.1:4'),
    ev('vc', 2, 'IngressAdopted', {
      vm_id: 'vc',
      adopt_from: { vm_id: 'vc', host_id: 'h1' },
      host_id: 'h2',
      routes: route('http://127.0.0.1:5'),
      at: at(7),
    }),
    ev('vd', 1, 'VmRequested', { vm_id: 'vd' }),
    published('vd', 2, 'http://127.0.0.1:6'),
    ev('vd', 3, 'VmFailed', { vm_id: 'vd' }),
  ];
  const rows = async (): Promise<unknown[]> =>
    (await db.pool.query('SELECT vm_id, host_id, routes, revision FROM ingress_routes ORDER BY vm_id')).rows;

  it('gives the rows of one event at a time, and is idempotent', async () => {
    for (const e of history()) await ingressProjection.apply(db.pool, e);
    const one = await rows();
    assert.deepEqual(
      one.map((r) => (r as { vm_id: string }).vm_id),
      ['va', 'vc'],
    );
    await db.pool.query('TRUNCATE ingress_routes');
    await ingressProjection.applyBatch!(db.pool, history());
    assert.deepEqual(await rows(), one);
    await ingressProjection.applyBatch!(db.pool, history());
    assert.deepEqual(await rows(), one, 'a second pass changes nothing');
  });
});
