import assert from 'node:assert/strict';
import { after, before, describe, it, type TestContext } from 'node:test';
import { bindAggregate } from '../../src/commands/command-handler.js';
import { CommandHandler } from '../../src/commands/command-handler.js';
import { vmAggregate } from '../../src/domain/vm/vm.aggregate.js';
import { validateVmSpec } from '../../src/domain/vm/spec.js';
import type { RunningAgent } from '../agent/harness.js';
import WebSocket from 'ws';
import {
  eventually,
  handshake,
  keyOf,
  problemOf,
  registerHost,
  startCheckedFleet,
  startControlPlane,
  type AgentFleet,
  type ControlPlane,
  type KeyName,
  type Reply,
} from '../support/control-plane.js';

/**
 * Why every VM ended, end to end (real agent, real sandboxes): each path that
 * ends a VM — client, admin, error, timeout, idle, exited, host_lost,
 * orphaned, evicted — leaves its reason in GET, the list filter, the JSON
 * events, the audit trail, the billing rows and /metrics. Then PATCH
 * (timeout extended keeps the VM), metadata filters, wait, and event paging.
 */
const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

function expectProblem(r: Reply, status: number, code: string): void {
  assert.equal(r.status, status, JSON.stringify(r.body));
  assert.equal(problemOf(r).code, code, JSON.stringify(r.body));
}

describe('VM lifecycle: reasons, timeouts, metadata, wait, events (real agent)', { timeout: 600_000 }, () => {
  let skip: string | undefined;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  let agent: RunningAgent;
  const ended = new Map<string, string>();

  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };
  const create = async (body: Record<string, unknown> = {}, as: KeyName = 'acme'): Promise<{ id: string; position: string }> => {
    const r = await cp!.request('POST', '/v1/vms', { as, body: { cpus: 1, ram_mb: 128, ...body } });
    assert.equal(r.status, 201, JSON.stringify(r.body));
    return r.body;
  };
  const stream = (id: string) => cp!.service.vms.get(id, { tenantId: 'admin', admin: true });
  const caughtUp = async (): Promise<void> => {
    const head = await cp!.service.store.headPosition();
    if (head) await cp!.service.runner.waitFor(head, 15_000);
  };

  before(async () => {
    const started = await startCheckedFleet();
    ({ fleet, skip } = started);
    if (skip) return;
    agent = started.agents[0]!;
    cp = await startControlPlane({
      env: { RECONCILE_GRACE_MS: '2000', ACTIVITY_COALESCE_MS: '100', RECONCILE_AGENT_TIMEOUT_MS: '10000' },
    });
    const r = await registerHost(cp, 'h1', agent, { capacity_overrides: { cpus: 32, ram_mb: 8192 } });
    assert.equal(r.status, 201, JSON.stringify(r.body));
    await caughtUp();
  });

  after(async () => {
    await cp?.close();
    await fleet?.close();
  });

  it('every path that ends a VM records its reason: client, admin, error, timeout, idle, exited, host_lost, orphaned, evicted', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vm = {
      client: await create(),
      admin: await create(),
      timeout: await create(),
      extended: await create({ max_runtime_s: 2 }),
      idle: await create({ idle_timeout_s: 1 }),
      exited: await create(),
      hostLost: await create(),
    };

    // client and admin: who destroyed it.
    assert.equal((await c.request('DELETE', `/v1/vms/${vm.client.id}`, { as: 'acme' })).body.reason, 'client');
    assert.equal((await c.request('DELETE', `/v1/vms/${vm.admin.id}`, { as: 'admin' })).body.reason, 'admin');
    ended.set(vm.client.id, 'client').set(vm.admin.id, 'admin');

    // error: the startup script fails; the VM ends with the phase and the code.
    const bad = await c.request('POST', '/v1/vms', {
      as: 'acme',
      headers: { 'idempotency-key': 'lifecycle-error' },
      body: { cpus: 1, ram_mb: 128, startup_script: 'exit 4' },
    });
    expectProblem(bad, 422, 'STARTUP_SCRIPT_FAILED');
    await caughtUp();
    const errored = (await c.request('GET', '/v1/vms?reason=error', { as: 'acme' })).body.vms;
    assert.equal(errored.length, 1, JSON.stringify(errored));
    assert.deepEqual([errored[0].state, errored[0].phase, errored[0].error_code], ['failed', 'booting', 'STARTUP_SCRIPT_FAILED']);
    ended.set(errored[0].id, 'error');

    // timeout: shortened to one second from now. extended: max_runtime_s 2 moved to ten minutes from now.
    const short = await c.request('PATCH', `/v1/vms/${vm.timeout.id}`, { as: 'acme', body: { timeout_s: 1 } });
    assert.equal(short.status, 200, JSON.stringify(short.body));
    const long = await c.request('PATCH', `/v1/vms/${vm.extended.id}`, { as: 'acme', body: { timeout_s: 600 } });
    assert.equal(long.status, 200, JSON.stringify(long.body));
    assert.ok(Date.parse(long.body.timeout_at) > Date.now() + 590_000, long.body.timeout_at);

    // exited: the sandbox's init (busybox) powers off on SIGUSR2 and, in a container, simply exits.
    await c.request('POST', `/v1/vms/${vm.exited.id}/exec`, { as: 'acme', body: { argv: ['kill', '-USR2', '1'], timeout_ms: 5000 } });
    await eventually(
      async () => (await agent.client.listVms('fl-')).find((v) => v.name === `fl-${vm.exited.id}`)?.state === 'stopped',
      20_000,
      'the init to end',
    );

    // host_lost: the host no longer has the sandbox (gone behind the control plane's back).
    await agent.client.destroyVm(`fl-${vm.hostLost.id}`, { force: true });

    // orphaned: a control plane that wrote VmRequested and died.
    const orphanId = 'orphan0000000000000000a1';
    const crashed = bindAggregate(new CommandHandler(c.service.store), vmAggregate);
    await crashed.handle(
      orphanId,
      { type: 'RequestVm', data: { vm_id: orphanId, spec: validateVmSpec({ cpus: 1, ram_mb: 128 }), tenant_id: 'acme' } },
      { correlationId: 'crashed', actor: 'tenant:acme', tenantId: 'acme' },
    );

    await sleep(2300); // past the timeout (1 s), idle (1 s + coalescing), max_runtime_s (2 s) and the grace (2 s)
    await caughtUp();
    const first = await c.service.reconciler.reconcileOnce();
    assert.equal(first.stuck_tasks_failed, 1, JSON.stringify(first));
    assert.equal(first.idle_vms_failed, 1);
    assert.equal(first.vms_exited, 1);
    assert.equal(first.half_done_rolled_back, 1);
    await c.service.reconciler.reconcileOnce(); // the second listing without it: host_lost
    const ends = {
      [vm.timeout.id]: ['failed', 'timeout', 'MAX_RUNTIME_EXCEEDED'],
      [vm.idle.id]: ['destroyed', 'idle', undefined],
      [vm.exited.id]: ['failed', 'exited', 'SANDBOX_EXITED'],
      [vm.hostLost.id]: ['failed', 'host_lost', 'SANDBOX_MISSING'],
      [orphanId]: ['failed', 'orphaned', 'INTERRUPTED'],
    };
    for (const [id, [state, reason, code]] of Object.entries(ends)) {
      const s = await stream(id);
      assert.deepEqual([s.status, s.status === 'failed' || s.status === 'destroyed' ? s.reason : undefined], [state, reason], id);
      if (code) assert.equal(s.status === 'failed' && s.error_code, code);
      ended.set(id, reason!);
    }
    // How the init ended is recorded by its parent: an exit code or a signal, never both, never neither.
    const exited = await stream(vm.exited.id);
    assert.ok(
      exited.status === 'failed' && (exited.exit_code === undefined) !== (exited.exit_signal === undefined),
      JSON.stringify(exited),
    );
    assert.equal((await stream(vm.extended.id)).status, 'running', 'a timeout extended past its old end keeps the VM');

    // evicted: the operator drains the host.
    const refused = await c.request('POST', '/v1/hosts/h1/drain', { as: 'acme' });
    expectProblem(refused, 403, 'FORBIDDEN');
    const drained = await c.request('POST', '/v1/hosts/h1/drain', { as: 'admin' });
    assert.equal(drained.status, 200, JSON.stringify(drained.body));
    assert.deepEqual(drained.body.evicted, [vm.extended.id]);
    assert.equal((await stream(vm.extended.id)).status, 'destroyed');
    ended.set(vm.extended.id, 'evicted');
    await caughtUp();
    assert.equal((await c.request('GET', '/v1/hosts/h1')).body.state, 'cordoned');
    const again = await c.request('POST', '/v1/hosts/h1/drain', { as: 'admin' });
    assert.deepEqual([again.status, again.body.evicted, again.body.failed], [200, [], []], 'a drain again is a no-op');
    assert.equal((await c.request('POST', '/v1/hosts/h1/uncordon', { as: 'admin' })).status, 200);
  });

  it('the reason is in GET, the ?reason= filter, the JSON events, the audit trail, the billing rows and /metrics', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    await caughtUp();
    assert.equal(new Set(ended.values()).size, 9, JSON.stringify([...ended]));
    for (const [id, reason] of ended) {
      const got = await c.request('GET', `/v1/vms/${id}`, { as: 'acme' });
      assert.equal(got.body.reason, reason, `GET ${id}`);
      const listed = await c.request('GET', `/v1/vms?reason=${reason}`, { as: 'acme' });
      assert.ok(
        listed.body.vms.some((v: { id: string }) => v.id === id),
        `?reason=${reason}`,
      );
      assert.ok(listed.body.vms.every((v: { reason: string }) => v.reason === reason));
      const events = (await c.request('GET', `/v1/vm-events?vm_id=${id}`, { as: 'acme' })).body.events;
      const last = events.at(-1);
      assert.ok(['vm.destroyed', 'vm.failed'].includes(last.event) && last.reason === reason, JSON.stringify(events));
      const audit = (await c.request('GET', `/v1/audit/streams/vm-${id}`, { as: 'acme' })).body.events;
      assert.ok(
        audit.some(
          (e: { type: string; data: { reason?: string }; end_reason?: string }) =>
            ['VmDestroyed', 'VmFailed'].includes(e.type) && e.data.reason === reason && e.end_reason === reason,
        ),
        `audit of ${id}`,
      );
    }
    expectProblem(await c.request('GET', '/v1/vms?reason=max_runtime', { as: 'acme' }), 400, 'VALIDATION_FAILED');

    const runs = (await c.request('GET', `/v1/usage/vms?from=${new Date(Date.now() - 3_600_000).toISOString()}`, { as: 'acme' })).body.vms;
    for (const [id, reason] of ended) {
      const run = runs.find((r: { vm_id: string }) => r.vm_id === id);
      // Only VMs that ran are billed: the error (boot never finished) and the orphan (never placed) are not.
      if (reason === 'error' || reason === 'orphaned') assert.equal(run, undefined, id);
      else assert.ok(run && run.reason === reason && run.vm_seconds > 0 && run.ended_at, JSON.stringify(run));
    }

    const metrics = String((await c.request('GET', '/metrics', { as: 'none' })).body);
    for (const reason of new Set(ended.values()))
      assert.match(metrics, new RegExp(`fleet_vm_ends_total\\{reason="${reason}"\\} [1-9]`), reason);
  });

  it('PATCH: bad input is a 400, another tenant a 404, a timeout on an ended VM a 409; nothing is half-written', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const v = await create({ metadata: { team: 'patch' } });
    for (const body of [{}, { timeout_s: 0 }, { timeout_s: 1.5 }, { timeout_s: -1 }, { metadata: { 'bad key': 'x' } }, { other: 1 }])
      expectProblem(await c.request('PATCH', `/v1/vms/${v.id}`, { as: 'acme', body }), 400, 'VALIDATION_FAILED');
    expectProblem(await c.request('PATCH', `/v1/vms/${v.id}`, { as: 'globex', body: { timeout_s: 5 } }), 404, 'VM_NOT_FOUND');
    const gone = [...ended.entries()].find(([, r]) => r === 'client')![0];
    const refused = await c.request('PATCH', `/v1/vms/${gone}`, { as: 'acme', body: { timeout_s: 5, metadata: { x: 'y' } } });
    expectProblem(refused, 409, 'VM_INVALID_STATE');
    assert.deepEqual((await stream(gone)).metadata, {}, 'the metadata of a refused PATCH is not written either');
    await c.request('DELETE', `/v1/vms/${v.id}`, { as: 'acme' });
  });

  it('metadata: given at create, returned everywhere, filterable (?metadata=key=value, repeated for AND), replaced by PATCH', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const a = await create({ metadata: { team: 'ml', run: '1' } });
    const b = await create({ metadata: { team: 'ml', run: '2' } });
    const g = await create({ metadata: { team: 'ml' } }, 'globex');
    await caughtUp();
    const ids = async (query: string, as: KeyName = 'acme'): Promise<string[]> => {
      const r = await c.request('GET', `/v1/vms?${query}`, { as });
      assert.equal(r.status, 200, JSON.stringify(r.body));
      return r.body.vms.map((v: { id: string }) => v.id).sort();
    };
    assert.deepEqual(await ids('metadata=team=ml'), [a.id, b.id].sort());
    assert.deepEqual(await ids('metadata=team=ml&metadata=run=2'), [b.id]);
    assert.deepEqual(await ids('metadata=team=ml', 'globex'), [g.id], 'a tenant filters its own VMs only');
    assert.deepEqual((await c.request('GET', `/v1/vms/${a.id}`, { as: 'acme' })).body.metadata, { team: 'ml', run: '1' });
    expectProblem(await c.request('GET', '/v1/vms?metadata=nokey', { as: 'acme' }), 400, 'VALIDATION_FAILED');
    expectProblem(await c.request('GET', '/v1/vms?metadata=team=a&metadata=team=b', { as: 'acme' }), 400, 'VALIDATION_FAILED');

    const patched = await c.request('PATCH', `/v1/vms/${a.id}`, { as: 'acme', body: { metadata: { team: 'web' } } });
    assert.deepEqual(patched.body.metadata, { team: 'web' });
    await c.service.runner.waitFor(patched.body.position, 10_000);
    assert.deepEqual(await ids('metadata=team=ml'), [b.id]);
    assert.deepEqual(await ids('metadata=team=web'), [a.id]);
    for (const v of [a, b]) await c.request('DELETE', `/v1/vms/${v.id}`, { as: 'acme' });
    await c.request('DELETE', `/v1/vms/${g.id}`, { as: 'globex' });
  });

  it('wait returns on the state change, on its timeout (408), and refuses a state the VM will never reach (409)', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const v = await create();
    const now = await c.request('GET', `/v1/vms/${v.id}/wait?state=running&timeout_s=5`, { as: 'acme' });
    assert.deepEqual([now.status, now.body.state], [200, 'running']);
    const t0 = Date.now();
    expectProblem(await c.request('GET', `/v1/vms/${v.id}/wait?state=destroyed&timeout_s=1`, { as: 'acme' }), 408, 'WAIT_TIMEOUT');
    assert.ok(Date.now() - t0 >= 1000);
    expectProblem(await c.request('GET', `/v1/vms/${v.id}/wait?state=destroyed&timeout_s=1`, { as: 'globex' }), 404, 'VM_NOT_FOUND');
    expectProblem(await c.request('GET', `/v1/vms/${v.id}/wait?state=paused`, { as: 'acme' }), 400, 'VALIDATION_FAILED');
    expectProblem(await c.request('GET', `/v1/vms/${v.id}/wait?state=running&timeout_s=100000`, { as: 'acme' }), 400, 'VALIDATION_FAILED');

    const waiting = c.request('GET', `/v1/vms/${v.id}/wait?state=destroyed&timeout_s=60`, { as: 'acme' });
    await sleep(300);
    await c.request('DELETE', `/v1/vms/${v.id}`, { as: 'acme' });
    const done = await waiting;
    assert.deepEqual([done.status, done.body.state, done.body.reason], [200, 'destroyed', 'client']);
    expectProblem(await c.request('GET', `/v1/vms/${v.id}/wait?state=running`, { as: 'acme' }), 409, 'VM_STATE_UNREACHABLE');
  });

  it('file transfers count as activity: last_activity_at moves', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const v = await create();
    await caughtUp();
    const before = (await c.request('GET', `/v1/vms/${v.id}`, { as: 'acme' })).body.last_activity_at;
    await sleep(200);
    const put = await c.request('PUT', `/v1/vms/${v.id}/files?path=/tmp/x`, {
      as: 'acme',
      rawBody: Buffer.from('x'),
      contentType: 'application/octet-stream',
    });
    assert.equal(put.status, 200, JSON.stringify(put.body));
    const moved = await eventually(
      async () => {
        await caughtUp();
        const now = (await c.request('GET', `/v1/vms/${v.id}`, { as: 'acme' })).body.last_activity_at;
        return Date.parse(now) > Date.parse(before) ? now : undefined;
      },
      10_000,
      'activity from an upload',
    );
    assert.ok(moved);
    await c.request('DELETE', `/v1/vms/${v.id}`, { as: 'acme' });
  });

  it('an open exec session counts as activity while it lasts, with no frames flowing', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const v = await create();
    const base = await c.listen();
    const ws = new WebSocket(`${base.replace('http', 'ws')}/v1/vms/${v.id}/exec`, {
      headers: { authorization: `Bearer ${keyOf('acme')}` },
    });
    await handshake(ws);
    const exited = new Promise<void>((resolve) => ws.once('close', () => resolve()));
    ws.send(JSON.stringify({ type: 'start', argv: ['sleep', '3'], timeout_ms: 10_000 }));
    await sleep(800); // the start itself is activity: look for what comes after it
    await caughtUp();
    const during = Date.parse((await c.request('GET', `/v1/vms/${v.id}`, { as: 'acme' })).body.last_activity_at);
    await sleep(1000);
    await caughtUp();
    const later = Date.parse((await c.request('GET', `/v1/vms/${v.id}`, { as: 'acme' })).body.last_activity_at);
    assert.ok(later > during, `activity recorded while the session is open (${during} → ${later})`);
    await exited;
    await c.request('DELETE', `/v1/vms/${v.id}`, { as: 'acme' });
  });

  it('lifecycle events as paged JSON: filters by vm, type and time, a cursor, and only the caller’s own', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    await caughtUp();
    const id = [...ended.entries()].find(([, r]) => r === 'client')![0];
    const all = (await c.request('GET', `/v1/vm-events?vm_id=${id}`, { as: 'acme' })).body.events;
    assert.deepEqual(
      all.map((e: { event: string }) => e.event),
      ['vm.requested', 'vm.placed', 'vm.booting', 'vm.booted', 'vm.destroying', 'vm.destroyed'],
    );
    const pages: string[] = [];
    let cursor: string | null = null;
    do {
      const r: Reply = await c.request('GET', `/v1/vm-events?vm_id=${id}&limit=4${cursor ? `&cursor=${cursor}` : ''}`, { as: 'acme' });
      assert.equal(r.status, 200, JSON.stringify(r.body));
      pages.push(...r.body.events.map((e: { id: string }) => e.id));
      cursor = r.body.next_cursor;
    } while (cursor);
    assert.deepEqual(
      pages,
      all.map((e: { id: string }) => e.id),
      'paging gives every event once, in order',
    );
    const failed = (await c.request('GET', '/v1/vm-events?type=vm.failed,vm.destroyed&limit=500', { as: 'acme' })).body.events;
    assert.ok(failed.length >= 9 && failed.every((e: { event: string }) => ['vm.failed', 'vm.destroyed'].includes(e.event)));
    const future = (await c.request('GET', `/v1/vm-events?since=${new Date(Date.now() + 60_000).toISOString()}`, { as: 'acme' })).body;
    assert.deepEqual(future.events, []);
    const theirs = (await c.request('GET', `/v1/vm-events?vm_id=${id}`, { as: 'globex' })).body.events;
    assert.deepEqual(theirs, [], "another tenant's VM has no events for you");
    expectProblem(await c.request('GET', '/v1/vm-events?tenant=acme', { as: 'globex' }), 403, 'FORBIDDEN');
    expectProblem(await c.request('GET', '/v1/vm-events?type=vm.exploded', { as: 'acme' }), 400, 'VALIDATION_FAILED');
    expectProblem(await c.request('GET', '/v1/vm-events?cursor=garbage', { as: 'acme' }), 400, 'INVALID_CURSOR');
  });
});
