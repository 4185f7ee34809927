import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { after, before, describe, it } from 'node:test';
import { promisify } from 'node:util';
import { hostEventSchema } from '../../src/domain/host/host.events.js';
import { ADMIN_KEY, KEYS, appendLifecycle, auth, lifecycle, startHarness, type Harness } from './support.js';

const run = promisify(execFile);
const T = (s: string): Date => new Date(`2026-05-01T${s}Z`);

describe('audit and replay', { timeout: 120_000 }, () => {
  let h: Harness;
  const positions: string[] = [];
  before(async () => {
    h = await startHarness('audit');
    const events = lifecycle('v1', 'acme', 'h1', { requested: T('09:00:00.000'), booted: T('09:00:02.000'), ended: T('10:00:00.000') });
    for (const e of events)
      positions.push(
        (await h.service.store.append('vm-v1', [{ ...e, metadata: { ...e.metadata, causationId: randomUUID() } }], 'any')).position,
      );
    await appendLifecycle(h.service.store, 'g1', lifecycle('g1', 'globex', 'h1', { requested: T('09:00:00.000') }));
    const cordoned = hostEventSchema.parse({
      type: 'HostCordoned',
      data: { host_id: 'h1', reason: 'maintenance', at: T('09:30:00.000').toISOString() },
    });
    await h.service.store.append(
      'host-h1',
      [{ id: randomUUID(), type: cordoned.type, data: cordoned.data, metadata: { actor: 'admin', correlationId: randomUUID() } }],
      'any',
    );
    await h.service.store.append(
      'tenant-acme',
      [
        {
          id: randomUUID(),
          type: 'QuotaReserved',
          data: { tenant_id: 'acme', snapshot_id: 's1', at: T('09:10:00.000').toISOString() },
          metadata: { actor: 'tenant:acme' },
        },
      ],
      'any',
    );
  });
  after(async () => h?.close());

  const get = (url: string, key: string) => h.service.app.inject({ url, headers: auth(key) });

  it('GET /v1/audit/streams/:stream: the full history with time, actor, correlation and causation, secrets sealed', async () => {
    const r = await get('/v1/audit/streams/vm-v1', KEYS.acme);
    assert.equal(r.statusCode, 200, r.body);
    const body = r.json();
    assert.equal(body.owner, 'acme');
    assert.deepEqual(
      body.events.map((e: { type: string }) => e.type),
      ['VmRequested', 'VmPlaced', 'VmBootStarted', 'VmBooted', 'VmDestroyRequested', 'VmDestroyed'],
    );
    assert.deepEqual(
      body.events.map((e: { position: string }) => e.position),
      positions,
    );
    assert.deepEqual(
      body.events.map((e: { revision: string }) => e.revision),
      ['0', '1', '2', '3', '4', '5'],
    );
    const first = body.events[0];
    assert.equal(first.time, '2026-05-01T09:00:00.000Z');
    assert.equal(first.actor, 'tenant:acme');
    assert.equal(first.tenant_id, 'acme');
    assert.match(first.correlation_id, /^[0-9a-f-]{36}$/);
    assert.match(first.causation_id, /^[0-9a-f-]{36}$/);
    const booted = body.events[3];
    assert.equal(booted.data.auth_token_encrypted, '[sealed]');
    assert.ok(!r.body.includes('c2VhbGVk'), 'no ciphertext in the audit output');
    assert.equal(body.next_revision, null);

    const page = (await get('/v1/audit/streams/vm-v1?limit=2&from_revision=2', KEYS.acme)).json();
    assert.deepEqual([page.events.map((e: { revision: string }) => e.revision), page.next_revision], [['2', '3'], '4']);
  });

  it('others get 404; hosts are admin-only; a tenant reads its own tenant stream', async () => {
    for (const [url, key, status] of [
      ['/v1/audit/streams/vm-v1', KEYS.globex, 404],
      ['/v1/audit/streams/vm-v1', ADMIN_KEY, 200],
      ['/v1/audit/streams/vm-nope', ADMIN_KEY, 404],
      ['/v1/audit/streams/vm-nope', KEYS.acme, 404],
      ['/v1/audit/streams/host-h1', KEYS.acme, 404],
      ['/v1/audit/streams/host-h1', ADMIN_KEY, 200],
      ['/v1/audit/streams/tenant-acme', KEYS.acme, 200],
      ['/v1/audit/streams/tenant-acme', KEYS.globex, 404],
      ['/v1/audit/streams/NOPE', ADMIN_KEY, 400],
    ] as const) {
      const r = await get(url, key);
      assert.equal(r.statusCode, status, `${url} → ${r.statusCode} ${r.body}`);
      if (status === 404) assert.equal(r.json().code, 'STREAM_NOT_FOUND');
    }
    const host = (await get('/v1/audit/streams/host-h1', ADMIN_KEY)).json();
    assert.equal(host.events[0].data.reason, 'maintenance');
  });

  it('GET /v1/vms/:id?as_of= folds the VM as it was at a time or a position', async () => {
    const at = async (asOf: string, key: string = KEYS.acme) => get(`/v1/vms/v1?as_of=${encodeURIComponent(asOf)}`, key);
    assert.equal((await at(positions[0]!)).json().state, 'requested');
    assert.equal((await at(positions[2]!)).json().state, 'booting');
    const running = (await at('2026-05-01T09:30:00Z')).json();
    assert.equal(running.state, 'running');
    assert.equal(running.host_id, 'h1');
    assert.equal(running.boot_ms, 2000);
    assert.equal((await at('2026-05-01T09:59:59.999Z')).json().state, 'destroying');
    const gone = (await at('2026-05-01T10:00:00Z')).json();
    assert.deepEqual([gone.state, gone.reason], ['destroyed', 'client']);
    const before = await at('2026-05-01T08:59:59Z');
    assert.equal(before.statusCode, 404);
    assert.equal(before.json().code, 'VM_NOT_FOUND');
    assert.equal((await at('2026-05-01T09:30:00Z', KEYS.globex)).statusCode, 404);
    assert.equal((await at('2026-05-01T09:30:00Z', ADMIN_KEY)).json().state, 'running');
    const bad = await at('yesterday');
    assert.equal(bad.statusCode, 400);
    assert.match(bad.json().detail, /neither a position .* nor an ISO-8601 time/);
  });

  it('documents the consumer routes in the OpenAPI document', async () => {
    const r = await h.service.app.inject({ url: '/openapi.json' });
    assert.equal(r.statusCode, 200);
    const paths = Object.keys(r.json().paths);
    for (const p of ['/v1/audit/streams/{stream}', '/v1/usage', '/v1/events']) assert.ok(paths.includes(p), `${p} in ${paths.join(', ')}`);
  });

  it('npm run fleet -- audit / vm --as-of print the same, readably', async () => {
    const env = { ...process.env, DATABASE_URL: h.db.url, LOG_LEVEL: 'silent' };
    const cli = (args: string[]) => run(process.execPath, ['--import', 'tsx', 'src/cli/fleet.ts', ...args], { env, timeout: 60_000 });
    const audit = await cli(['audit', 'vm-v1']);
    assert.match(audit.stdout, /^vm-v1: 6 event\(s\)/);
    assert.match(
      audit.stdout,
      /# {3}3 {2}2026-05-01T09:00:02.000Z {2}VmBooted\n\s+position [0-9a-f]{16}-[0-9a-f]{16} {2}actor tenant:acme {2}tenant acme\n\s+correlation [0-9a-f-]{36} {2}causation [0-9a-f-]{36}/,
    );
    assert.match(audit.stdout, /"auth_token_encrypted":"\[sealed\]"/);
    const upTo = await cli(['audit', 'vm-v1', '--as-of', positions[1]!]);
    assert.match(upTo.stdout, /^vm-v1: 2 event\(s\) up to/);
    const vm = await cli(['vm', 'v1', '--as-of', '2026-05-01T09:30:00Z']);
    assert.match(vm.stdout, /^vm\s+v1\n/);
    assert.match(vm.stdout, /\nstate\s+running\n/);
    assert.match(vm.stdout, /\nspec\s+2 CPU, 1024 MB RAM, 1 GB disk\n/);
    await assert.rejects(
      cli(['vm', 'v1', '--as-of', '2020-01-01T00:00:00Z']),
      (err: { code: number; stderr: string }) => err.code === 1 && /did not exist/.test(err.stderr),
    );
    await assert.rejects(cli(['vm', 'v1']), (err: { code: number; stderr: string }) => err.code === 2 && /needs --as-of/.test(err.stderr));
  });
});
