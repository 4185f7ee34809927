import assert from 'node:assert/strict';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { after, before, describe, it, type TestContext } from 'node:test';
import { hostTokenContext, legacyHostTokenContext } from '../../src/commands/host/host-commands.js';
import { AesGcmSecretBox } from '../../src/adapters/crypto.js';
import { pino } from 'pino';
import { startService, apiKeysFrom, type Service } from '../../src/adapters/service.js';
import type { RunningAgent } from '../agent/harness.js';
import { registerHost, startCheckedFleet, startControlPlane, type AgentFleet, type ControlPlane } from '../support/control-plane.js';

/**
 * A host token is sealed with the host's id and URL as associated data: a
 * record whose URL is changed (an edited event, a restored backup of another
 * fleet) does not send the token anywhere. Tokens sealed under the old
 * context (id only) still open once and are sealed again.
 */
describe('host token sealed with the host URL', { timeout: 120_000 }, () => {
  let skip: string | undefined;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  let agent: RunningAgent;
  let trap: http.Server | undefined;
  const seen: string[] = [];

  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };
  const editRegistered = async (hostId: string, patch: Record<string, string>): Promise<void> => {
    const r = await cp!.db.pool.query(
      `UPDATE es_events SET data = (data::jsonb || $2::jsonb)::json WHERE stream_id = $1 AND type = 'HostRegistered'`,
      [`host-${hostId}`, JSON.stringify(patch)],
    );
    assert.equal(r.rowCount, 1);
  };

  const meta = { correlationId: 'test', actor: 'admin', tenantId: 'admin' };
  /** A second replica on the same database: nothing cached, the records are read as they are now. */
  const replica = async (): Promise<Service> =>
    startService({
      config: cp!.config,
      logger: pino({ level: 'silent' }),
      databaseUrl: cp!.db.url,
      tokenEncryptionKey: cp!.tokenKey,
      apiKeys: apiKeysFrom('admin-key-for-the-replica-0000', []),
      defaultMetrics: false,
      httpLogger: false,
    });

  before(async () => {
    const started = await startCheckedFleet();
    ({ fleet, skip } = started);
    agent = started.agents[0]!;
    if (skip) return;
    cp = await startControlPlane();
    // Where a tampered record would send the token: it records every Authorization header it gets.
    trap = http.createServer((req, res) => {
      seen.push(req.headers.authorization ?? '');
      res.statusCode = 500;
      res.end();
    });
    await new Promise<void>((r) => trap!.listen(0, '127.0.0.1', r));
  });

  after(async () => {
    trap?.close();
    await cp?.close();
    await fleet?.close();
  });

  it('does not open under another URL: the token is not sent to where an edited record points', async (t) => {
    if (guard(t)) return;
    assert.equal((await registerHost(cp!, 'ht1', agent)).status, 201);
    assert.equal((await cp!.request('POST', '/v1/hosts/ht1/probe')).status, 200);
    const trapUrl = `http://127.0.0.1:${(trap!.address() as AddressInfo).port}`;
    await editRegistered('ht1', { url: trapUrl });
    const svc = await replica();
    try {
      await assert.rejects(svc.hosts.probe('ht1', meta), (err: Error & { code?: string }) => err.code === 'HOST_TOKEN_UNREADABLE');
    } finally {
      await svc.close();
    }
    assert.ok(!seen.some((h) => h.includes(agent.token)), 'the trap never received the token');

    const box = new AesGcmSecretBox(cp!.tokenKey);
    const sealed = box.seal(agent.token, hostTokenContext('ht1', agent.url));
    assert.throws(() => box.open(sealed, hostTokenContext('ht1', trapUrl)));
    assert.equal(box.open(sealed, hostTokenContext('ht1', agent.url)), agent.token);
  });

  it('opens a token sealed under the old context once, then seals it again with the URL', async (t) => {
    if (guard(t)) return;
    assert.equal((await registerHost(cp!, 'ht2', agent)).status, 201);
    const box = new AesGcmSecretBox(cp!.tokenKey);
    const legacy = box.seal(agent.token, legacyHostTokenContext('ht2'));
    await editRegistered('ht2', { token_encrypted: legacy });
    const svc = await replica();
    try {
      await svc.hosts.probe('ht2', meta);
      await svc.hosts.resealed();
      await svc.hosts.probe('ht2', meta);
      await svc.hosts.resealed();
    } finally {
      await svc.close();
    }
    const events = await cp!.service.store.readStream('host-ht2');
    const resealed = events.filter((e) => e.type === 'HostTokenResealed');
    assert.equal(resealed.length, 1, events.map((e) => e.type).join(', '));
    const token = (resealed[0]!.data as { token_encrypted: string }).token_encrypted;
    assert.equal(box.open(token, hostTokenContext('ht2', agent.url)), agent.token);
    // The first service had the old record folded in memory: its next write finds the reseal and uses the new token.
    assert.equal((await cp!.request('POST', '/v1/hosts/ht2/probe')).status, 200);
    assert.equal(
      (await cp!.service.store.readStream('host-ht2')).filter((e) => e.type === 'HostTokenResealed').length,
      1,
      'sealed again once, not on every use',
    );
    const audit = await cp!.request('GET', '/v1/audit/streams/host-ht2');
    assert.ok(!JSON.stringify(audit.body).includes(token), 'audit shows the new ciphertext sealed');
  });
});
