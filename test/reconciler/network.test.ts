import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { after, before, describe, test } from 'node:test';
import { pino } from 'pino';
import { configSchema } from '../../src/adapters/config.js';
import { apiKeysFrom, startService, type Service } from '../../src/adapters/service.js';
import { createTestDatabase, type TestDatabase } from '../support/postgres.js';
import { ADMIN_KEY, prepareTestImages, skipReason, startTestAgent, TOKEN_KEY, waitFor, type TestAgent } from './harness.js';
import { registerHostRequestSchema } from '../../src/commands/host/host-commands.js';

/**
 * Each cycle the reconciler has every host re-assert its sandbox network
 * boundary (POST /v1/network/reassert on a real agent) and counts what had
 * to be repaired, in its summary and in /metrics.
 */
const prereq =
  (await skipReason()) ?? (spawnSync('sh', ['-c', 'command -v nft']).status === 0 ? undefined : 'nft (apt-get install nftables)');

describe('reconciler: network boundary repairs', { skip: prereq, timeout: 180_000 }, () => {
  let images: { imageDir: string } | { skip: string };
  let agent: TestAgent | undefined;
  let db: TestDatabase | undefined;
  let svc: Service | undefined;
  const inject = async (method: 'GET' | 'POST', url: string, payload?: unknown) => {
    const r = await svc!.app.inject({
      method,
      url,
      headers: { authorization: `Bearer ${ADMIN_KEY}` },
      ...(payload !== undefined ? { payload: payload as object } : {}),
    });
    return { status: r.statusCode, body: r.body };
  };

  before(async () => {
    images = await prepareTestImages();
    if ('skip' in images) return;
    agent = await startTestAgent(images.imageDir);
    db = await createTestDatabase('rec_network');
    svc = await startService({
      config: configSchema.parse({
        RECONCILER_ENABLED: 'false',
        RECONCILE_AGENT_TIMEOUT_MS: '10000',
        READ_YOUR_WRITES_TIMEOUT_MS: '10000',
      }),
      logger: pino({ level: process.env.FLEET_TEST_LOG ?? 'silent' }),
      databaseUrl: db.url,
      tokenEncryptionKey: Buffer.from(TOKEN_KEY, 'base64'),
      apiKeys: apiKeysFrom(ADMIN_KEY, []),
      defaultMetrics: false,
      httpLogger: false,
    });
    await svc.hosts.register(
      registerHostRequestSchema.parse({
        id: 'h1',
        url: agent.url,
        token: agent.token,
        backend: 'process',
        capacity_overrides: { cpus: 8, ram_mb: 4096 },
      }),
      { correlationId: 't', actor: 'test' },
    );
    await waitFor('host in the read model', 10_000, async () => JSON.parse((await inject('GET', '/v1/hosts')).body).hosts?.length === 1);
  });

  after(async () => {
    await svc?.close();
    await agent?.dispose();
    if (agent) for (const family of ['inet', 'bridge']) spawnSync('nft', ['delete', 'table', family, `fleet_${agent.opts.bridgePrefix}`]);
    await db?.drop();
  });

  test('a firewall table deleted by hand is put back by the next cycle and counted once, in the summary and in /metrics', async (t) => {
    if ('skip' in images) return t.skip(images.skip);
    const table = `fleet_${agent!.opts.bridgePrefix}`;
    const created = await inject('POST', '/v1/vms', { cpus: 1, ram_mb: 128 });
    assert.equal(created.status, 201, created.body);
    const quiet = await svc!.reconciler.reconcileOnce();
    assert.equal(quiet.network_repairs, 0, 'nothing had drifted');
    assert.equal(quiet.errors, 0);

    assert.equal(spawnSync('nft', ['delete', 'table', 'inet', table]).status, 0);
    const s = await svc!.reconciler.reconcileOnce();
    assert.equal(s.network_repairs, 1);
    assert.equal(spawnSync('nft', ['list', 'table', 'inet', table]).status, 0, 'the table is back');
    assert.equal((await svc!.reconciler.reconcileOnce()).network_repairs, 0, 'repaired once, not every cycle');

    const metrics = (await inject('GET', '/metrics')).body;
    assert.match(metrics, /^fleet_reconcile_actions_total\{kind="network_repairs"\} 1$/m);
    assert.match(metrics, /^fleet_reconcile_last_cycle\{field="network_repairs"\} 0$/m);

    // The route itself, as an operator would call it.
    assert.deepEqual(await agent!.client.reassertNetwork(), { repaired: 0, repairs: [] });
  });
});
