import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { after, before, describe, it, type TestContext } from 'node:test';
import { verifySignature } from '../../src/adapters/webhooks/signature.js';
import type { RunningAgent } from '../agent/harness.js';
import {
  eventually,
  registerHost,
  startCheckedFleet,
  startControlPlane,
  type AgentFleet,
  type ControlPlane,
} from '../support/control-plane.js';

/**
 * Signed webhooks end to end: a receiver on loopback (allowed by the
 * operator flag in this control plane) gets every lifecycle event of a real
 * VM, in order, each signed; an answer of 500 is retried; a delivery that
 * keeps failing goes dead and an operator's retry sends it again. A second
 * control plane without the flag refuses loopback, private and link-local
 * targets at creation, and again at delivery (a target that turned
 * internal after it was accepted).
 */

interface Received {
  path: string;
  headers: Record<string, string | string[] | undefined>;
  body: string;
  status: number;
}

describe('webhooks (real agent, loopback receiver)', { timeout: 300_000 }, () => {
  let skip: string | undefined;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  let strict: ControlPlane | undefined;
  let agent: RunningAgent;
  let receiver: Server;
  let base = '';
  const received: Received[] = [];
  let failBootedOnce = true;
  let deadFails = true;
  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };

  before(async () => {
    receiver = createServer((req, res) => {
      let body = '';
      req.setEncoding('utf8');
      req.on('data', (d: string) => (body += d));
      req.on('end', () => {
        const event = (JSON.parse(body) as { event: string }).event;
        let status = 200;
        if (req.url === '/hook' && event === 'vm.booted' && failBootedOnce) {
          failBootedOnce = false;
          status = 500;
        }
        if (req.url === '/dead' && deadFails) status = 500;
        received.push({ path: req.url ?? '', headers: req.headers, body, status });
        res.writeHead(status).end();
      });
    });
    await new Promise<void>((r) => receiver.listen(0, '127.0.0.1', r));
    base = `http://127.0.0.1:${(receiver.address() as AddressInfo).port}`;
    strict = await startControlPlane({ env: { WEBHOOK_DISPATCH_INTERVAL_MS: '100' } });
    const started = await startCheckedFleet(1);
    ({ fleet, skip } = started);
    if (skip) return;
    agent = started.agents[0]!;
    cp = await startControlPlane({
      env: {
        WEBHOOK_ALLOW_PRIVATE: 'true',
        WEBHOOK_DISPATCH_INTERVAL_MS: '100',
        WEBHOOK_RETRY_BASE_MS: '200',
        WEBHOOK_MAX_ATTEMPTS: '2',
      },
    });
    const r = await registerHost(cp, 'hw', agent, { capacity_overrides: { cpus: 8 } });
    assert.equal(r.status, 201, JSON.stringify(r.body));
    await cp.service.runner.waitFor(r.body.position, 20_000);
  });

  after(async () => {
    await cp?.close();
    await strict?.close();
    await fleet?.close();
    await new Promise((r) => receiver.close(r));
  });

  it('a tenant webhook to loopback, private or link-local space is refused without the operator flag', async () => {
    for (const url of [`${base}/hook`, 'http://localhost:9/x', 'http://10.1.2.3/x', 'http://169.254.169.254/latest', 'http://[::1]/x']) {
      const r = await strict!.request('POST', '/v1/webhooks', { as: 'acme', body: { url } });
      assert.equal(r.status, 422, `${url}: ${JSON.stringify(r.body)}`);
      assert.equal(r.body.code, 'WEBHOOK_TARGET_FORBIDDEN');
    }
    const bad = await strict!.request('POST', '/v1/webhooks', { as: 'acme', body: { url: 'ftp://example.org/' } });
    assert.equal(bad.status, 422);
    const types = await strict!.request('POST', '/v1/webhooks', {
      as: 'acme',
      body: { url: 'http://203.0.113.9/', event_types: ['vm.nope'] },
    });
    assert.equal(types.status, 400);
    assert.equal((await strict!.request('GET', '/v1/webhooks', { as: 'acme' })).body.webhooks.length, 0);
  });

  it('a target that turned internal after it was accepted is refused at delivery time', async () => {
    // As if a name that resolved to a public address at creation now resolves to loopback: the webhook is in the
    // log (appended directly, past the creation check) and an event for its tenant comes.
    const id = 'wh-rebound';
    const at = new Date().toISOString();
    const store = strict!.service.store;
    const { AesGcmSecretBox } = await import('../../src/adapters/crypto.js');
    const sealed = new AesGcmSecretBox(strict!.tokenKey).seal('whsec_test', `webhook-secret:${id}`);
    await store.append(
      `webhook-${id}`,
      [
        {
          id: randomUUID(),
          type: 'WebhookCreated',
          data: { webhook_id: id, tenant_id: 'acme', url: `${base}/rebound`, event_types: ['vm.requested'], secret_sealed: sealed, at },
        },
      ],
      'no_stream',
    );
    await store.append(
      'vm-rebound-vm',
      [
        {
          id: randomUUID(),
          type: 'VmRequested',
          data: { vm_id: 'rebound-vm', tenant_id: 'acme', spec: { cpus: 1, ram_mb: 128, disk_gb: 1 }, at },
        },
      ],
      'no_stream',
    );
    const d = await eventually(
      async () => {
        const r = await strict!.request('GET', `/v1/webhooks/${id}/deliveries`, { as: 'acme' });
        const first = r.body.deliveries?.[0];
        return first?.last_error ? first : undefined;
      },
      15_000,
      'a failed attempt',
    );
    assert.match(d.last_error, /forbidden/);
    assert.equal(received.filter((x) => x.path === '/rebound').length, 0, 'nothing reached the internal target');
  });

  it('every lifecycle event of a VM reaches the receiver in order, signed; a 500 is retried', async (t) => {
    if (guard(t)) return;
    const created = await cp!.request('POST', '/v1/webhooks', { as: 'acme', body: { url: `${base}/hook` } });
    assert.equal(created.status, 201, JSON.stringify(created.body));
    const secret = created.body.secret as string;
    assert.match(secret, /^whsec_/);
    const hook = created.body.id as string;
    const shown = await cp!.request('GET', `/v1/webhooks/${hook}`, { as: 'acme' });
    assert.equal(shown.status, 200);
    assert.equal(shown.body.secret, undefined, 'the secret is shown once');
    assert.equal((await cp!.request('GET', `/v1/webhooks/${hook}`, { as: 'globex' })).status, 404);
    assert.equal((await cp!.request('GET', `/v1/webhooks/${hook}/deliveries`, { as: 'globex' })).status, 404);

    const vm = await cp!.request('POST', '/v1/vms', { as: 'acme', body: { cpus: 1, ram_mb: 128 } });
    assert.equal(vm.status, 201, JSON.stringify(vm.body));
    const id = vm.body.id as string;
    // Another tenant's VM reaches no acme webhook.
    const other = await cp!.request('POST', '/v1/vms', { as: 'globex', body: { cpus: 1, ram_mb: 128 } });
    assert.equal(other.status, 201);
    assert.equal((await cp!.request('DELETE', `/v1/vms/${id}`, { as: 'acme' })).status, 200);
    await cp!.request('DELETE', `/v1/vms/${other.body.id as string}`, { as: 'globex' });

    const want = ['vm.requested', 'vm.placed', 'vm.booting', 'vm.booted', 'vm.destroying', 'vm.destroyed'];
    const ok = await eventually(
      () => {
        const got = received.filter((r) => r.path === '/hook' && r.status === 200);
        return Promise.resolve(got.length >= want.length ? got : undefined);
      },
      30_000,
      'every event delivered',
    );
    const bodies = ok.map((r) => JSON.parse(r.body) as { id: string; event: string; vm_id: string; data: { reason?: string } });
    assert.deepEqual(
      bodies.map((b) => b.event),
      want,
    );
    assert.ok(bodies.every((b) => b.vm_id === id));
    assert.equal(bodies.at(-1)!.data.reason, 'client');
    for (const r of received.filter((x) => x.path === '/hook')) {
      assert.ok(verifySignature(secret, r.body, String(r.headers['fleet-signature'])), `signed: ${String(r.headers['fleet-signature'])}`);
      assert.equal(verifySignature('whsec_wrong', r.body, String(r.headers['fleet-signature'])), false);
    }
    // The booted delivery failed once with 500, then went through: same delivery id, twice on the wire.
    const booted = received.filter((r) => r.path === '/hook' && (JSON.parse(r.body) as { event: string }).event === 'vm.booted');
    assert.deepEqual(
      booted.map((r) => r.status),
      [500, 200],
    );
    assert.equal(booted[0]!.headers['fleet-delivery-id'], booted[1]!.headers['fleet-delivery-id']);
    const ds = await cp!.request('GET', `/v1/webhooks/${hook}/deliveries`, { as: 'acme' });
    const bootedRow = (ds.body.deliveries as Array<{ event: string; attempts: number; status: string }>).find(
      (d) => d.event === 'vm.booted',
    )!;
    assert.equal(bootedRow.status, 'delivered');
    assert.equal(bootedRow.attempts, 2);
    assert.equal(ds.body.deliveries.length, want.length);
  });

  it('a delivery failing past WEBHOOK_MAX_ATTEMPTS is dead until an operator retries it', async (t) => {
    if (guard(t)) return;
    const created = await cp!.request('POST', '/v1/webhooks', { as: 'acme', body: { url: `${base}/dead`, event_types: ['vm.requested'] } });
    assert.equal(created.status, 201);
    const hook = created.body.id as string;
    const vm = await cp!.request('POST', '/v1/vms', { as: 'acme', body: { cpus: 1, ram_mb: 128 } });
    assert.equal(vm.status, 201);
    const dead = await eventually(
      async () => {
        const r = await cp!.request('GET', `/v1/webhooks/${hook}/deliveries?status=dead`, { as: 'acme' });
        return r.body.deliveries[0] as { id: string; attempts: number; last_status: number } | undefined;
      },
      20_000,
      'a dead delivery',
    );
    assert.equal(dead.attempts, 2);
    assert.equal(dead.last_status, 500);
    const byTenant = await cp!.request('POST', `/v1/webhooks/${hook}/deliveries/${dead.id}/retry`, { as: 'acme' });
    assert.equal(byTenant.status, 403);
    deadFails = false;
    const retried = await cp!.request('POST', `/v1/webhooks/${hook}/deliveries/${dead.id}/retry`, { as: 'admin' });
    assert.equal(retried.status, 200, JSON.stringify(retried.body));
    assert.equal((await cp!.request('POST', `/v1/webhooks/${hook}/deliveries/${dead.id}/retry`, { as: 'admin' })).status, 409);
    await eventually(
      async () => {
        const r = await cp!.request('GET', `/v1/webhooks/${hook}/deliveries?status=delivered`, { as: 'acme' });
        return r.body.deliveries.length === 1;
      },
      10_000,
      'the retried delivery',
    );
    await cp!.request('DELETE', `/v1/vms/${vm.body.id as string}`, { as: 'acme' });
    const del = await cp!.request('DELETE', `/v1/webhooks/${hook}`, { as: 'acme' });
    assert.equal(del.status, 200);
    assert.equal((await cp!.request('GET', `/v1/webhooks/${hook}`, { as: 'acme' })).status, 404);
  });
  it('vm.failed carries how an ended init ended: its exit code, or the signal that killed it', async (t) => {
    if (guard(t)) return;
    const created = await cp!.request('POST', '/v1/webhooks', { as: 'acme', body: { url: `${base}/exit`, event_types: ['vm.failed'] } });
    assert.equal(created.status, 201, JSON.stringify(created.body));
    const at = new Date().toISOString();
    // Ends as the reconciler's verdict records them (appended directly: the paths themselves are tested with real sandboxes).
    const ends: Array<[string, Record<string, unknown>]> = [
      ['exitcode-vm', { reason: 'exited', error_code: 'SANDBOX_EXITED', exit_code: 3 }],
      ['exitsig-vm', { reason: 'oom', error_code: 'OOM_KILLED', exit_signal: 'SIGKILL' }],
    ];
    for (const [vm, end] of ends)
      await cp!.service.store.append(
        `vm-${vm}`,
        [
          { id: randomUUID(), type: 'VmRequested', data: { vm_id: vm, tenant_id: 'acme', spec: { cpus: 1, ram_mb: 128, disk_gb: 1 }, at } },
          { id: randomUUID(), type: 'VmFailed', data: { vm_id: vm, error: 'the init ended', phase: 'running', at, ...end } },
        ],
        'no_stream',
      );
    const got = await eventually(
      () => {
        const bodies = received.filter((r) => r.path === '/exit' && r.status === 200).map((r) => JSON.parse(r.body));
        return Promise.resolve(bodies.length >= 2 ? bodies : undefined);
      },
      30_000,
      'both vm.failed deliveries',
    );
    const byVm = Object.fromEntries(
      got.map((b: { vm_id: string; data: Record<string, unknown> }) => [b.vm_id, [b.data.reason, b.data.exit_code, b.data.exit_signal]]),
    );
    assert.deepEqual(byVm, { 'exitcode-vm': ['exited', 3, undefined], 'exitsig-vm': ['oom', undefined, 'SIGKILL'] });
  });
});
