import assert from 'node:assert/strict';
import { randomBytes, randomUUID } from 'node:crypto';
import { Writable } from 'node:stream';
import { after, before, describe, it, type TestContext } from 'node:test';
import { pino } from 'pino';
import { loggerOptions } from '../../src/adapters/logger.js';
import { rebuildProjection } from '../../src/projections/rebuild.js';
import { vmsProjection } from '../../src/projections/vms/vms.projection.js';
import type { RunningAgent } from '../agent/harness.js';
import { registerHost, startCheckedFleet, startControlPlane, type AgentFleet, type ControlPlane } from '../support/control-plane.js';

/**
 * Secrets on create, and the startup script and agent command that may hold
 * credentials too: sealed in events, never in a read, a log or the audit
 * trail, yet there inside the guest (startup script, in-guest agent, exec).
 * A real service whose pino output (with the production options) is kept,
 * a real agent and sandbox.
 */
describe('VM secrets', { timeout: 240_000 }, () => {
  let skip: string | undefined;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  let agent: RunningAgent;
  let logs = '';
  const secret = `s3cr3t-${randomBytes(12).toString('hex')}`;
  const scriptCred = `scriptcred-${randomBytes(12).toString('hex')}`;
  const agentCred = `agentcred-${randomBytes(12).toString('hex')}`;
  const values = [secret, scriptCred, agentCred];
  let vmId = '';

  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };
  const assertClean = (text: string, where: string): void => {
    for (const v of values) assert.ok(!text.includes(v), `${where} holds a sealed value (${v.slice(0, 10)}…)`);
  };

  before(async () => {
    const started = await startCheckedFleet();
    ({ fleet, skip } = started);
    agent = started.agents[0]!;
    if (skip) return;
    const sink = new Writable({
      write(chunk: Buffer, _enc, done) {
        logs += chunk.toString();
        done();
      },
    });
    // The production options (redaction included) at the most talkative level.
    const logger = pino({ ...loggerOptions('trace'), transport: undefined }, sink);
    cp = await startControlPlane({ logger, env: { EXEC_DEFAULT_TIMEOUT_MS: '20000' } });
    const h = await registerHost(cp, 'hs', agent, { capacity_overrides: { cpus: 8 } });
    assert.equal(h.status, 201, JSON.stringify(h.body));
  });

  after(async () => {
    await cp?.close();
    await fleet?.close();
  });

  it('refuses bad secrets with a 400 that does not quote the value', async (t) => {
    if (guard(t)) return;
    const badName = await cp!.request('POST', '/v1/vms', { as: 'acme', body: { secrets: { '1BAD': secret } } });
    assert.equal(badName.status, 400);
    assert.equal(badName.body.code, 'VALIDATION_FAILED');
    const big = await cp!.request('POST', '/v1/vms', { as: 'acme', body: { secrets: { BIG: `${secret}${'x'.repeat(40_000)}` } } });
    assert.equal(big.status, 400);
    const many = await cp!.request('POST', '/v1/vms', {
      as: 'acme',
      body: { secrets: Object.fromEntries(Array.from({ length: 65 }, (_, i) => [`S${i}`, secret])) },
    });
    assert.equal(many.status, 400);
    for (const r of [badName, big, many]) assertClean(JSON.stringify(r.body), '400 body');
  });

  it('gives the secrets to the startup script, the in-guest agent and execs', async (t) => {
    if (guard(t)) return;
    const created = await cp!.request('POST', '/v1/vms', {
      as: 'acme',
      body: {
        ram_mb: 256,
        secrets: { MY_SECRET: secret },
        startup_script: `CRED=${scriptCred}\necho "$MY_SECRET" > /root/startup-saw`,
        agent: {
          command: `echo "$MY_SECRET" > /root/agent-saw; TOKEN=${agentCred} sleep 600`,
          drain_command: `curl -H 'x: ${agentCred}' deregister`,
        },
      },
    });
    assert.equal(created.status, 201, JSON.stringify(created.body));
    vmId = created.body.id;
    assertClean(JSON.stringify(created.body), 'create response');
    assert.equal(created.body.spec.startup_script, '[sealed]');
    assert.equal(created.body.spec.agent.command, '[sealed]');
    assert.equal(created.body.spec.agent.drain_command, '[sealed]');

    const exec = await cp!.request('POST', `/v1/vms/${vmId}/exec`, { as: 'acme', body: { argv: ['sh', '-c', 'echo $MY_SECRET'] } });
    assert.equal(exec.status, 200, JSON.stringify(exec.body));
    assert.equal(exec.body.stdout.trim(), secret);
    const startup = await cp!.request('POST', `/v1/vms/${vmId}/exec`, { as: 'acme', body: { argv: ['cat', '/root/startup-saw'] } });
    assert.equal(startup.body.stdout.trim(), secret, 'the startup script saw the secret');
    let agentSaw = '';
    for (let i = 0; i < 50 && agentSaw === ''; i++) {
      const r = await cp!.request('POST', `/v1/vms/${vmId}/exec`, {
        as: 'acme',
        body: { argv: ['sh', '-c', 'cat /root/agent-saw 2>/dev/null || true'] },
      });
      agentSaw = String(r.body.stdout).trim();
      if (agentSaw === '') await new Promise((r2) => setTimeout(r2, 100));
    }
    assert.equal(agentSaw, secret, 'the in-guest agent saw the secret');
  });

  it('keeps them out of every read: GET, list, as_of, placement, audit, events feed', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const reads = [
      await c.request('GET', `/v1/vms/${vmId}`, { as: 'acme' }),
      await c.request('GET', '/v1/vms', { as: 'acme' }),
      await c.request('GET', '/v1/vms', { as: 'admin' }),
      await c.request('GET', `/v1/vms/${vmId}?as_of=${encodeURIComponent(new Date().toISOString())}`, { as: 'acme' }),
      await c.request('GET', `/v1/vms/${vmId}/placement`, { as: 'acme' }),
      await c.request('GET', `/v1/audit/streams/vm-${vmId}`, { as: 'acme' }),
      await c.request('GET', `/v1/audit/streams/vm-${vmId}`, { as: 'admin' }),
    ];
    for (const r of reads) {
      assert.equal(r.status, 200, JSON.stringify(r.body));
      assertClean(JSON.stringify(r.body), r.raw.raw.req.url ?? 'a read');
    }
    assert.equal(reads[0]!.body.spec.startup_script, '[sealed]');
    assert.equal(reads[3]!.body.spec.startup_script, '[sealed]', 'as_of folds the sealed spec and shows it sealed');
    const requested = reads[5]!.body.events.find((e: { type: string }) => e.type === 'VmRequested');
    assert.equal(requested.data.spec.startup_script_encrypted, '[sealed]');
    assert.equal(requested.data.spec.secrets_encrypted, '[sealed]');
    assert.equal(requested.data.spec.agent.command_encrypted, '[sealed]');
    assert.equal(requested.data.spec.agent.drain_command_encrypted, '[sealed]');

    const address = await c.listen();
    const ac = new AbortController();
    const feed = await fetch(`${address}/v1/events`, { headers: { authorization: `Bearer acme-${'b'.repeat(24)}` }, signal: ac.signal });
    let text = '';
    const reader = feed.body!.getReader();
    const deadline = Date.now() + 3000;
    while (Date.now() < deadline && !text.includes('caught-up')) {
      const { value, done } = await Promise.race([
        reader.read(),
        new Promise<{ value: undefined; done: true }>((r) => setTimeout(() => r({ value: undefined, done: true }), 500)),
      ]);
      if (value) text += Buffer.from(value).toString();
      if (done && !value) continue;
    }
    ac.abort();
    assert.match(text, /vm\.requested/);
    assertClean(text, 'events feed');
  });

  it('stores only ciphertext: no value anywhere in the raw events table or the read models', async (t) => {
    if (guard(t)) return;
    const pool = cp!.db.pool;
    const events = await pool.query<{ dump: string }>(`SELECT string_agg(e::text, E'\\n') AS dump FROM es_events e`);
    assert.match(events.rows[0]!.dump, /startup_script_encrypted/);
    assertClean(events.rows[0]!.dump, 'es_events');
    const vms = await pool.query<{ dump: string }>(`SELECT string_agg(v::text, E'\\n') AS dump FROM vms v`);
    assertClean(vms.rows[0]!.dump, 'vms read model');
  });

  it('scrubs a secret a failing startup script prints from the error, the event and the response', async (t) => {
    if (guard(t)) return;
    const r = await cp!.request('POST', '/v1/vms', {
      as: 'acme',
      body: { ram_mb: 256, secrets: { MY_SECRET: secret }, startup_script: 'echo "oops $MY_SECRET" >&2; exit 3' },
    });
    assert.equal(r.status, 422, JSON.stringify(r.body));
    assert.match(r.body.detail, /oops \[sealed\]/);
    assertClean(JSON.stringify(r.body), 'failure response');
    const events = await cp!.db.pool.query<{ dump: string }>(`SELECT string_agg(e::text, E'\\n') AS dump FROM es_events e`);
    assertClean(events.rows[0]!.dump, 'es_events after a failed boot');
  });

  it('reads an event written before sealing (clear startup script and agent command) as sealed, and a rebuild of the vms read model matches', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const oldId = `0ld${randomBytes(10).toString('hex')}`;
    const oldCred = `oldcred-${randomBytes(8).toString('hex')}`;
    const appended = await c.service.store.append(
      `vm-${oldId}`,
      [
        {
          id: randomUUID(),
          type: 'VmRequested',
          data: {
            vm_id: oldId,
            tenant_id: 'acme',
            at: new Date().toISOString(),
            spec: {
              cpus: 1,
              ram_mb: 256,
              storage_gb: 1,
              gpus: 0,
              startup_script: `export PW=${oldCred}`,
              agent: { command: `run ${oldCred}`, expose: [] },
            },
          },
          metadata: { actor: 'acme', tenantId: 'acme', correlationId: 'old' },
        },
      ],
      'no_stream',
    );
    const got = await c.request('GET', `/v1/vms/${oldId}?after=${appended.position}`, { as: 'acme' });
    assert.equal(got.status, 200, JSON.stringify(got.body));
    assert.equal(got.body.spec.startup_script, '[sealed]');
    assert.equal(got.body.spec.agent.command, '[sealed]');
    const asOf = await c.request('GET', `/v1/vms/${oldId}?as_of=${appended.position}`, { as: 'acme' });
    const audit = await c.request('GET', `/v1/audit/streams/vm-${oldId}`, { as: 'acme' });
    assert.equal(audit.body.events[0].data.spec.startup_script, '[sealed]');
    for (const r of [got, asOf, audit]) assert.ok(!JSON.stringify(r.body).includes(oldCred), JSON.stringify(r.body));
    const row = await c.db.pool.query<{ spec: string }>(`SELECT spec::text FROM vms WHERE id = $1`, [oldId]);
    assert.ok(!row.rows[0]!.spec.includes(oldCred), 'the read model keeps no clear script');
    // A row written by the code before sealing held the clear script: the read model's migration masks it.
    await c.db.pool.query(
      `UPDATE vms SET spec = jsonb_set(jsonb_set(spec, '{startup_script}', to_jsonb($2::text)), '{agent,command}', to_jsonb($2::text)) WHERE id = $1`,
      [oldId, `export PW=${oldCred}`],
    );
    await c.db.pool.query(vmsProjection.migrations.find((m) => m.id === 'vms_0002_sealed_spec')!.sql);
    const masked = await c.db.pool.query<{ spec: { startup_script: string; agent: { command: string } } }>(
      `SELECT spec FROM vms WHERE id = $1`,
      [oldId],
    );
    assert.deepEqual([masked.rows[0]!.spec.startup_script, masked.rows[0]!.spec.agent.command], ['[sealed]', '[sealed]']);
    const report = await rebuildProjection(c.service.store, c.db.pool, vmsProjection, { verify: true });
    for (const d of report.drift) assert.deepEqual([d.table, d.onlyLive, d.onlyRebuilt], [d.table, 0, 0]);
  });

  it('never logs them', (t) => {
    if (guard(t)) return;
    assert.ok(logs.length > 1000, 'the service logged (requests at least)');
    assert.match(logs, /POST|\/v1\/vms/);
    assertClean(logs, 'the service log');
  });
});
