import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { webhookOutboxMigrations, webhookOutboxProjection } from '../../src/projections/webhooks/webhook-outbox.projection.js';
import { until } from '../event-store/postgres-helpers.js';
import { readAllEvents } from '../control-plane/host-streams.js';
import { startStubAgents, type StubAgents } from '../control-plane/stub-agent.js';
import { startControlPlane, type ControlPlane } from '../support/control-plane.js';

/**
 * The webhook outbox applies a run of events in a few statements: the
 * deliveries it enqueued live (two tenants, a webhook created and one deleted
 * between VMs, creates, a destroy) must be exactly — rows and `seq` order —
 * those that applying the same log one event at a time gives.
 */
describe('webhook outbox: a run at once equals one event at a time', { timeout: 120_000 }, () => {
  let stub: StubAgents;
  let cp: ControlPlane;
  before(async () => {
    stub = await startStubAgents();
    // Deliveries go to a closed port and are retried; only the rows enqueued matter here.
    cp = await startControlPlane({ env: { WEBHOOK_ALLOW_PRIVATE: 'true', WEBHOOK_DISPATCH_INTERVAL_MS: '60000' } });
  });
  after(async () => {
    await cp?.close();
    await stub?.close();
  });

  it('enqueues the same deliveries in the same order', async () => {
    const { url, token } = stub.add('wh1', { vm_count: 100, cpus: 100, ram_mb: 1_000_000, storage_gb: 10_000 });
    const reg = await cp.request('POST', '/v1/hosts', { body: { id: 'wh1', url, token } });
    assert.equal(reg.status, 201, JSON.stringify(reg.body));
    const hook = async (as: 'acme' | 'globex', body: Record<string, unknown>) => {
      const r = await cp.request('POST', '/v1/webhooks', { as, body: { url: 'http://127.0.0.1:9/hook', ...body } });
      assert.equal(r.status, 201, JSON.stringify(r.body));
      return r.body.id as string;
    };
    const vm = async (as: 'acme' | 'globex') => {
      const r = await cp.request('POST', '/v1/vms', { as, body: { image: 'base', cpus: 1, ram_mb: 128 } });
      assert.equal(r.status, 201, JSON.stringify(r.body));
      return r.body.id as string;
    };
    await vm('acme'); // before any webhook: nothing to deliver
    const all = await hook('acme', {});
    await hook('acme', { event_types: ['vm.booted', 'vm.destroyed'] });
    const first = await vm('acme');
    const gone = await hook('globex', {});
    await Promise.all([vm('acme'), vm('globex'), vm('acme')]);
    assert.equal((await cp.request('DELETE', `/v1/webhooks/${gone}`, { as: 'globex' })).status, 200);
    await vm('globex');
    assert.equal((await cp.request('DELETE', `/v1/vms/${first}`, { as: 'acme' })).status, 200);
    // The destroy answers before its VmDestroyed is written: wait for it, so the log compared below is complete.
    await until('the destroy to finish', async () =>
      (await readAllEvents(cp.service.store)).some((e) => e.streamId === `vm-${first}` && e.type === 'VmDestroyed'),
    );
    const head = await cp.service.store.headPosition();
    await cp.service.webhooks.runner.waitFor(head!, 20_000);

    const columns = 'id, webhook_id, tenant_id, vm_id, event_type, event_id, position, payload';
    const live = (await cp.db.pool.query(`SELECT ${columns} FROM webhook_deliveries ORDER BY seq`)).rows;
    assert.ok(live.some((r: { webhook_id: string }) => r.webhook_id === all));
    assert.ok(live.some((r: { webhook_id: string }) => r.webhook_id === gone));

    // The same log into schemas of their own: one event per call of `apply`, and all of it in ONE call of
    // `applyBatch`. Live batches are small and hold a webhook's event between VM events only by chance;
    // this one always has to split its runs at them (the match below).
    const events = await readAllEvents(cp.service.store);
    const kinds = events.map((e) => (e.streamId.startsWith('webhook-') ? 'w' : e.streamId.startsWith('vm-') ? 'v' : '')).join('');
    assert.match(kinds, /v+w+v+w+v+/, 'webhook events between runs of VM events');
    const client = await cp.db.pool.connect();
    try {
      const into = async (schema: string, apply: () => Promise<void>) => {
        await client.query('BEGIN');
        await client.query(`CREATE SCHEMA ${schema}`);
        await client.query(`SET LOCAL search_path TO ${schema}`);
        for (const m of webhookOutboxMigrations) await client.query(m.sql);
        await apply();
        const rows = (await client.query(`SELECT ${columns} FROM webhook_deliveries ORDER BY seq`)).rows;
        await client.query('ROLLBACK');
        return rows;
      };
      const oneByOne = await into('outbox_one_by_one', async () => {
        for (const e of events) await webhookOutboxProjection.apply(client, e);
      });
      const atOnce = await into('outbox_at_once', async () => {
        assert.ok(typeof webhookOutboxProjection.applyBatch === 'function');
        await webhookOutboxProjection.applyBatch(client, events);
      });
      assert.ok(oneByOne.length >= 10, `deliveries: ${oneByOne.length}`);
      assert.deepEqual(live, oneByOne);
      assert.deepEqual(atOnce, oneByOne);
    } finally {
      client.release();
    }
  });
});
