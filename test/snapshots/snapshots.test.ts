import assert from 'node:assert/strict';
import { after, before, describe, it, type TestContext } from 'node:test';
import type { RunningAgent } from '../agent/harness.js';
import { rebuildProjection } from '../../src/projections/rebuild.js';
import { snapshotsProjection } from '../../src/projections/snapshots/snapshots.projection.js';
import { findSnapshotByLayerKey, listSnapshotsByDigest } from '../../src/projections/snapshots/snapshots.queries.js';
import { pino } from 'pino';
import { apiKeysFrom, startService, type Service } from '../../src/adapters/service.js';
import type { Actor } from '../../src/commands/vm/vm-commands.js';
import { AppError } from '@fleet/agent-protocol';
import {
  ADMIN_KEY,
  eventually,
  problemOf,
  registerHost,
  startControlPlane,
  type AgentFleet,
  type ControlPlane,
  type Reply,
  startCheckedFleet,
} from '../support/control-plane.js';
import { parseVmSpec } from '../../src/domain/vm/spec.js';
import { snapshotRequest } from '../../src/commands/snapshot/snapshot-commands.js';

/**
 * Snapshots, quota, the artifact index, moves, the layer cache, fork and
 * cold migration through the API, with two real host-agent processes
 * (process backend; skips naming the missing feature without root/namespaces).
 * Tests run in order and build on each other.
 */

function expectProblem(r: Reply, status: number, code: string): void {
  assert.equal(r.status, status, `expected ${status} ${code}, got ${r.status}: ${JSON.stringify(r.body)}`);
  assert.equal(problemOf(r).code, code, JSON.stringify(r.body));
}
function ok(r: Reply, status = 200): any {
  assert.equal(r.status, status, JSON.stringify(r.body));
  return r.body;
}

// These tests pin a host without memory checkpoints (test/agent/criu*.test.ts cover CRIU): a live request is filed as disk.
process.env.CRIU_PATH = 'off';

describe('snapshots, artifacts, layers, fork and migrate (two real agents)', { timeout: 600_000 }, () => {
  let skip: string | undefined;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  const agents: RunningAgent[] = [];
  const st: { vm?: string; s1?: any; s2?: any; s3?: any; arch?: string; seeded?: string } = {};

  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };
  const exec = async (
    vm: string,
    cmd: string,
    as: 'acme' | 'globex' = 'acme',
  ): Promise<{ exit_code: number; stdout: string; stderr: string }> =>
    ok(await cp!.request('POST', `/v1/vms/${vm}/exec`, { as, body: { argv: ['/bin/sh', '-c', cmd] } }));

  before(async () => {
    const started = await startCheckedFleet(2);
    ({ fleet, skip } = started);
    agents.push(...started.agents);
    if (skip) {
      process.stderr.write(`snapshot tests skipped: ${skip}\n`);
      return;
    }
    cp = await startControlPlane({
      env: {
        SNAPSHOT_QUOTA_MAX_COUNT: '10',
        ARTIFACT_PULL_TIMEOUT_MS: '60000',
        RECONCILER_ENABLED: 'false',
        EXEC_DEFAULT_TIMEOUT_MS: '20000',
      },
    });
    ok(await registerHost(cp, 'h1', agents[0]!), 201);
    ok(await registerHost(cp, 'h2', agents[1]!), 201);
  });

  let second: Service | undefined;
  after(async () => {
    await second?.close();
    await cp?.close();
    await fleet?.close();
  });

  it('snapshots a running VM: ready with digest, size, host, arch; kind is what the agent produced; lineage; reserved metadata', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vm = ok(await c.request('POST', '/v1/vms', { as: 'acme', body: { host_id: 'h1', cpus: 1, ram_mb: 256 } }), 201);
    st.vm = vm.id;
    assert.equal((await exec(vm.id, 'echo hello-from-source > /root/marker && sync')).exit_code, 0);

    expectProblem(
      await c.request('POST', `/v1/vms/${vm.id}/snapshots`, { as: 'acme', body: { metadata: { comment: 'x' } } }),
      400,
      'VALIDATION_FAILED',
    );
    expectProblem(await c.request('POST', `/v1/vms/${vm.id}/snapshots`, { as: 'acme', body: { diff: true } }), 400, 'VALIDATION_FAILED');
    expectProblem(await c.request('POST', `/v1/vms/${vm.id}/snapshots`, { as: 'globex', body: {} }), 404, 'VM_NOT_FOUND');

    const s1 = ok(
      await c.request('POST', `/v1/vms/${vm.id}/snapshots`, {
        as: 'acme',
        body: { comment: 'first', metadata: { name: 'base' }, live: true },
      }),
      201,
    );
    assert.equal(s1.state, 'ready');
    assert.equal(s1.kind, 'disk', 'a live request served by a disk-only backend is filed as disk');
    assert.match(s1.digest, /^[0-9a-f]{64}$/);
    assert.ok(s1.size_bytes > 0);
    assert.equal(s1.host_id, 'h1');
    assert.ok(s1.arch.length > 0);
    assert.deepEqual(s1.holders, ['h1']);
    assert.equal(s1.parent_snapshot_id, null);
    assert.equal(s1.metadata.comment, 'first');
    assert.equal(s1.metadata.vm_id, vm.id);
    assert.equal(s1.metadata.name, 'base');
    st.arch = s1.arch;
    const events = await c.service.store.readStream(`snapshot-${s1.id}`);
    assert.deepEqual(
      events.map((e) => e.type),
      ['SnapshotRequested', 'SnapshotTaken'],
    );
    assert.equal((events[0]!.data as any).ask.live, true, 'what was asked is recorded as asked');

    const s2 = ok(
      await c.request('POST', `/v1/vms/${vm.id}/snapshots?after=${s1.position}`, {
        as: 'acme',
        body: { comment: 'second', retention_s: 3600 },
      }),
      201,
    );
    assert.equal(s2.parent_snapshot_id, s1.id, 'lineage to the previous snapshot');
    assert.ok(s2.retention_until);
    const s3 = ok(
      await c.request('POST', `/v1/vms/${vm.id}/snapshots`, { as: 'acme', body: { no_lineage: true, mode: 'checkpoint' } }),
      201,
    );
    assert.equal(s3.parent_snapshot_id, null);
    assert.equal(s3.mode, 'checkpoint');
    Object.assign(st, { s1, s2, s3 });
    const onAgent = await agents[0]!.client.listCheckpoints();
    for (const s of [s1, s2, s3])
      assert.ok(
        onAgent.some((cp) => cp.id === s.id && cp.digest === s.digest),
        `agent holds ${s.id}`,
      );
  });

  it('lists with filters and cursor pagination, gets by id; another tenant sees nothing (404)', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const after = `after=${st.s3.position}`;
    const all = ok(await c.request('GET', `/v1/snapshots?vm_id=${st.vm}&${after}`, { as: 'acme' }));
    assert.deepEqual(
      all.snapshots.map((s: any) => s.id),
      [st.s3.id, st.s2.id, st.s1.id],
    );
    const p1 = ok(await c.request('GET', `/v1/snapshots?vm_id=${st.vm}&limit=2`, { as: 'acme' }));
    assert.equal(p1.snapshots.length, 2);
    const p2 = ok(await c.request('GET', `/v1/snapshots?vm_id=${st.vm}&limit=2&cursor=${p1.next_cursor}`, { as: 'acme' }));
    assert.deepEqual(
      p2.snapshots.map((s: any) => s.id),
      [st.s1.id],
    );
    assert.deepEqual(
      ok(await c.request('GET', `/v1/snapshots?name=base`, { as: 'acme' })).snapshots.map((s: any) => s.id),
      [st.s1.id],
    );
    assert.deepEqual(
      ok(await c.request('GET', `/v1/snapshots?mode=checkpoint`, { as: 'acme' })).snapshots.map((s: any) => s.id),
      [st.s3.id],
    );
    assert.equal(ok(await c.request('GET', `/v1/snapshots/${st.s1.id}`, { as: 'acme' })).id, st.s1.id);
    expectProblem(await c.request('GET', `/v1/snapshots/${st.s1.id}`, { as: 'globex' }), 404, 'SNAPSHOT_NOT_FOUND');
    expectProblem(await c.request('DELETE', `/v1/snapshots/${st.s1.id}`, { as: 'globex' }), 404, 'SNAPSHOT_NOT_FOUND');
    assert.deepEqual(ok(await c.request('GET', `/v1/snapshots`, { as: 'globex' })).snapshots, []);
    expectProblem(await c.request('GET', `/v1/snapshots?cursor=garbage`, { as: 'acme' }), 400, 'INVALID_CURSOR');
  });

  it('records export intents and their status', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const r = ok(
      await c.request('POST', `/v1/snapshots/${st.s2.id}/exports`, { as: 'acme', body: { destination: 's3://bucket/s2' } }),
      201,
    );
    assert.equal(r.exports[0].status, 'pending');
    const u = ok(
      await c.request('PATCH', `/v1/snapshots/${st.s2.id}/exports`, {
        as: 'acme',
        body: { destination: 's3://bucket/s2', status: 'failed', error: 'denied' },
      }),
    );
    assert.equal(u.exports[0].status, 'failed');
    assert.equal(u.exports[0].last_error, 'denied');
    const row = ok(await c.request('GET', `/v1/snapshots/${st.s2.id}?after=${u.position}`, { as: 'acme' }));
    assert.equal(row.exports[0].status, 'failed');
  });

  it('artifact index: the caller tenant only; a cross-tenant digest match is a miss', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const mine = ok(await c.request('GET', `/v1/artifacts/${st.s1.digest}`, { as: 'acme' }));
    assert.deepEqual(mine.hosts, ['h1']);
    assert.ok(mine.snapshots.some((s: any) => s.id === st.s1.id));
    assert.deepEqual(ok(await c.request('GET', `/v1/artifacts/${st.s1.digest}`, { as: 'globex' })), {
      digest: st.s1.digest,
      snapshots: [],
      hosts: [],
    });
    assert.equal((await listSnapshotsByDigest(c.service.pool, 'globex', st.s1.digest)).length, 0);
    assert.ok((await listSnapshotsByDigest(c.service.pool, 'acme', st.s1.digest)).length >= 1);
  });

  it('creates a VM from a snapshot on a host without it: moved (grant, pull, digest), recorded, then booted; holders preferred after', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    expectProblem(await c.request('POST', '/v1/vms', { as: 'globex', body: { seed_snapshot_id: st.s1.id } }), 404, 'SNAPSHOT_NOT_FOUND');
    const vm = ok(
      await c.request('POST', '/v1/vms', { as: 'acme', body: { seed_snapshot_id: st.s1.id, host_id: 'h2', cpus: 1, ram_mb: 256 } }),
      201,
    );
    assert.equal(vm.host_id, 'h2');
    const placement = ok(await c.request('GET', `/v1/vms/${vm.id}/placement`, { as: 'acme' }));
    assert.equal(placement.artifact_local, false, 'the decision says a transfer happened');
    assert.equal((await exec(vm.id, 'cat /root/marker')).stdout.trim(), 'hello-from-source');
    const evs = await c.service.store.readStream(`snapshot-${st.s1.id}`);
    const moved = evs.find((e) => e.type === 'SnapshotArtifactMoved');
    assert.ok(moved, 'the move is an event');
    assert.equal((moved.data as any).to_host_id, 'h2');
    const s = ok(await c.request('GET', `/v1/snapshots/${st.s1.id}?after=${vm.position}`, { as: 'acme' }));
    assert.deepEqual(s.holders, ['h1', 'h2']);
    assert.deepEqual(ok(await c.request('GET', `/v1/artifacts/${st.s1.digest}`, { as: 'acme' })).hosts, ['h1', 'h2']);
    assert.ok((await agents[1]!.client.listCheckpoints()).some((cp) => cp.id === st.s1.id && cp.digest === st.s1.digest));

    const again = ok(await c.request('POST', '/v1/vms', { as: 'acme', body: { seed_snapshot_id: st.s2.id, cpus: 1, ram_mb: 256 } }), 201);
    const p2 = ok(await c.request('GET', `/v1/vms/${again.id}/placement`, { as: 'acme' }));
    assert.equal(again.host_id, 'h1', 'the only holder wins the tie-break');
    assert.equal(p2.artifact_local, true);
    assert.equal(p2.artifact_holders, 1);
    ok(await c.request('DELETE', `/v1/vms/${again.id}`, { as: 'acme' }));
    st.seeded = vm.id;
  });

  it('two seeded creates racing onto the same host: both boot, one move recorded, one new holder', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    if (st.seeded) ok(await c.request('DELETE', `/v1/vms/${st.seeded}`, { as: 'acme' })); // room on h2
    st.seeded = undefined;
    const [a, b] = await Promise.all(
      [0, 1].map(() =>
        c.request('POST', '/v1/vms', { as: 'acme', body: { seed_snapshot_id: st.s3.id, host_id: 'h2', cpus: 1, ram_mb: 256 } }),
      ),
    );
    const va = ok(a!, 201);
    const vb = ok(b!, 201);
    for (const v of [va, vb]) assert.equal((await exec(v.id, 'cat /root/marker')).stdout.trim(), 'hello-from-source');
    const moves = (await c.service.store.readStream(`snapshot-${st.s3.id}`)).filter((e) => e.type === 'SnapshotArtifactMoved');
    assert.equal(moves.length, 1, 'one move recorded');
    const s3 = ok(await c.request('GET', `/v1/snapshots/${st.s3.id}?after=${vb.position}`, { as: 'acme' }));
    assert.deepEqual(s3.holders, ['h1', 'h2']);
    for (const v of [va, vb]) ok(await c.request('DELETE', `/v1/vms/${v.id}`, { as: 'acme' }));
  });

  it('delete: refused while a later snapshot depends on it, forced then; the agents drop their copies', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const refused = await c.request('DELETE', `/v1/snapshots/${st.s1.id}`, { as: 'acme' });
    expectProblem(refused, 409, 'SNAPSHOT_HAS_DEPENDENTS');
    assert.deepEqual(problemOf(refused as any) && refused.body.details.dependents, [st.s2.id]);
    const d = ok(await c.request('DELETE', `/v1/snapshots/${st.s1.id}?force=true`, { as: 'acme' }));
    assert.equal(d.state, 'deleted');
    assert.deepEqual(d.holders, []);
    for (const a of agents) assert.ok(!(await a.client.listCheckpoints()).some((cp) => cp.id === st.s1.id));
    ok(await c.request('DELETE', `/v1/snapshots/${st.s1.id}`, { as: 'acme' }), 200);
  });

  it('layer cache: filed under the caller tenant, newest ready for (key, arch), arch filters, another tenant misses', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    expectProblem(
      await c.request('POST', `/v1/vms/${st.vm}/snapshots`, { as: 'acme', body: { layer_key: 'k1' } }),
      400,
      'VALIDATION_FAILED',
    );
    const l1 = ok(
      await c.request('POST', `/v1/vms/${st.vm}/snapshots`, { as: 'acme', body: { mode: 'build', layer_key: 'recipe:k1' } }),
      201,
    );
    const l2 = ok(
      await c.request('POST', `/v1/vms/${st.vm}/snapshots`, { as: 'acme', body: { mode: 'build', layer_key: 'recipe:k1' } }),
      201,
    );
    const hit = ok(await c.request('GET', `/v1/layers/recipe:k1?arch=${st.arch}&after=${l2.position}`, { as: 'acme' }));
    assert.equal(hit.id, l2.id, 'newest ready layer');
    assert.notEqual(l1.id, l2.id);
    expectProblem(await c.request('GET', `/v1/layers/recipe:k1?arch=not-${st.arch}`, { as: 'acme' }), 404, 'LAYER_NOT_FOUND');
    expectProblem(await c.request('GET', `/v1/layers/recipe:k1?arch=${st.arch}`, { as: 'globex' }), 404, 'LAYER_NOT_FOUND');
    assert.equal(await findSnapshotByLayerKey(c.service.pool, 'globex', 'recipe:k1', st.arch!), undefined);
    assert.equal((await findSnapshotByLayerKey(c.service.pool, 'acme', 'recipe:k1', st.arch!))?.id, l2.id);
    assert.equal(await findSnapshotByLayerKey(c.service.pool, 'acme', '', st.arch!), undefined, 'an empty key never matches');
    const usage = ok(await c.request('GET', '/v1/snapshot-quota', { as: 'acme' }));
    assert.equal(usage.count, 2, `build artifacts are not counted (s2, s3 are): ${JSON.stringify(usage)}`);
  });

  it('fork: a new VM from a snapshot of the source, with its own token', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const f = ok(await c.request('POST', `/v1/vms/${st.vm}/fork`, { as: 'acme', body: { comment: 'fork it' } }), 201);
    assert.notEqual(f.id, st.vm);
    assert.equal(f.state, 'running');
    assert.equal((await exec(f.id, 'cat /root/marker')).stdout.trim(), 'hello-from-source');
    const tokSrc = (await exec(st.vm!, 'cat /etc/fleet/token')).stdout;
    const tokFork = (await exec(f.id, 'cat /etc/fleet/token')).stdout;
    assert.ok(tokSrc.length > 0, 'source has a token');
    assert.notEqual(tokFork, tokSrc, 'a copy never speaks as its source');
    const reuse = ok(
      await c.request('POST', `/v1/vms/${st.vm}/fork`, { as: 'acme', body: { reuse_snapshot_id: f.seed_snapshot_id } }),
      201,
    );
    assert.equal(reuse.seed_snapshot_id, f.seed_snapshot_id);
    expectProblem(await c.request('POST', `/v1/vms/${st.vm}/fork`, { as: 'globex', body: {} }), 404, 'VM_NOT_FOUND');
    for (const id of [f.id, reuse.id]) ok(await c.request('DELETE', `/v1/vms/${id}`, { as: 'acme' }));
  });

  it('migrate: live is refused on the process backend while the source runs; a failed step leaves the source running; cold keeps the id', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vmId = st.vm!;
    expectProblem(
      await c.request('POST', `/v1/vms/${vmId}/migrate`, { as: 'acme', body: { live: true } }),
      409,
      'LIVE_MIGRATION_UNSUPPORTED',
    );
    assert.equal(ok(await c.request('GET', `/v1/vms/${vmId}`, { as: 'acme' })).state, 'running');
    expectProblem(
      await c.request('POST', `/v1/vms/${vmId}/migrate`, { as: 'acme', body: { target_host_id: 'h1' } }),
      400,
      'MIGRATION_TARGET_IS_SOURCE',
    );

    // A cordoned target: the flow stops at "place" and says so; the source still answers.
    ok(await c.request('POST', '/v1/hosts/h2/cordon', { body: {} }));
    const failed = await c.request('POST', `/v1/vms/${vmId}/migrate`, { as: 'acme', body: { target_host_id: 'h2' } });
    expectProblem(failed, 409, 'MIGRATION_FAILED');
    assert.equal(failed.body.details.step, 'place');
    assert.equal((await exec(vmId, 'cat /root/marker')).stdout.trim(), 'hello-from-source');
    ok(await c.request('POST', '/v1/hosts/h2/uncordon', { body: {} }));

    const m = ok(await c.request('POST', `/v1/vms/${vmId}/migrate`, { as: 'acme', body: {} }));
    assert.equal(m.id, vmId, 'the VM keeps its id');
    assert.equal(m.host_id, 'h2');
    assert.equal(m.from_host_id, 'h1');
    assert.equal(m.state, 'running');
    assert.equal((await exec(vmId, 'cat /root/marker')).stdout.trim(), 'hello-from-source');
    assert.ok(!(await agents[0]!.client.listVms('')).some((v) => v.name === `fl-${vmId}`), 'the source sandbox is gone');
    const types = (await c.service.store.readStream(`vm-${vmId}`)).map((e) => e.type);
    const tail = types.slice(types.lastIndexOf('VmMigrationStarted'));
    assert.deepEqual(tail, [
      'VmMigrationStarted',
      'VmMigrationStepCompleted',
      'VmMigrationStepCompleted',
      'VmMigrationStepCompleted',
      'VmMigrationStepCompleted',
      'VmMigrated',
      'VmMigrationStepCompleted',
      'VmMigrationStepCompleted',
    ]);
    assert.ok(types.includes('VmMigrationFailed'), 'the failed attempt is in the stream too');
    const row = ok(await c.request('GET', `/v1/vms/${vmId}?after=${m.position}`, { as: 'acme' }));
    assert.equal(row.host_id, 'h2');
    const migrateSnap = ok(await c.request('GET', `/v1/snapshots/${m.snapshot_id}?after=${m.position}`, { as: 'acme' }));
    assert.equal(migrateSnap.state, 'deleted');
  });

  it('quota: 50 concurrent snapshot requests against a quota of 10 → exactly 10 accepted, 40 QUOTA_EXCEEDED naming limit and usage', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vm = ok(await c.request('POST', '/v1/vms', { as: 'globex', body: { cpus: 1, ram_mb: 256 } }), 201);
    const replies = await Promise.all(
      Array.from({ length: 50 }, (_, i) =>
        c.request('POST', `/v1/vms/${vm.id}/snapshots`, { as: 'globex', body: { comment: `race ${i}`, no_lineage: true } }),
      ),
    );
    const accepted = replies.filter((r) => r.status === 201);
    const refused = replies.filter((r) => r.status !== 201);
    assert.equal(
      accepted.length,
      10,
      replies
        .filter((r) => r.status !== 201 && r.status !== 429)
        .map((r) => JSON.stringify(r.body))
        .join('\n'),
    );
    assert.equal(refused.length, 40);
    for (const r of refused) {
      expectProblem(r, 429, 'QUOTA_EXCEEDED');
      const d = r.body.details;
      assert.equal(d.limit, 10);
      assert.equal(d.usage.count, 10);
      assert.match(problemOf(r).detail, /10 of 10 snapshots/);
    }
    const reserved = (await c.service.store.readStream('tenant-globex')).filter((e) => e.type === 'SnapshotQuotaReserved');
    assert.equal(reserved.length, 10);
    // A delete frees a slot.
    ok(await c.request('DELETE', `/v1/snapshots/${accepted[0]!.body.id}`, { as: 'globex' }));
    ok(await c.request('POST', `/v1/vms/${vm.id}/snapshots`, { as: 'globex', body: {} }), 201);
    expectProblem(await c.request('POST', `/v1/vms/${vm.id}/snapshots`, { as: 'globex', body: {} }), 429, 'QUOTA_EXCEEDED');
    ok(await c.request('DELETE', `/v1/vms/${vm.id}`, { as: 'globex' }));
  });

  it('quota across two control-plane processes sharing one event store: still exactly 10 of 50', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    // A second replica: its own in-process queues, so the tenant stream's expected revision is the only guard between the two.
    second = await startService({
      config: { ...c.config, ARTIFACT_MAX_PER_TENANT: 1, ARTIFACT_IDLE_TTL_MS: 3_600_000, RECONCILER_ENABLED: false },
      logger: pino({ level: 'silent' }),
      databaseUrl: c.db.url,
      tokenEncryptionKey: c.tokenKey,
      apiKeys: apiKeysFrom(ADMIN_KEY, []),
      defaultMetrics: false,
      httpLogger: false,
    });
    const actor: Actor = { correlationId: 'quota-race-2', actor: 'admin', tenantId: 'admin', admin: true };
    const vm = await c.service.vms.create(parseVmSpec({ cpus: 1, ram_mb: 256 }), actor);
    const services = [c.service, second];
    const results = await Promise.allSettled(
      Array.from({ length: 50 }, (_, i) =>
        services[i % 2]!.snapshots.create(vm.vm.vm_id, snapshotRequest({ no_lineage: true, comment: `r${i}` }), actor),
      ),
    );
    const codes = results.map((r) => (r.status === 'fulfilled' ? 'ok' : r.reason instanceof AppError ? r.reason.code : String(r.reason)));
    assert.equal(codes.filter((x) => x === 'ok').length, 10, codes.join(','));
    assert.equal(codes.filter((x) => x === 'QUOTA_EXCEEDED').length, 40, codes.join(','));
    assert.equal((await c.service.store.readStream('tenant-admin')).filter((e) => e.type === 'SnapshotQuotaReserved').length, 10);
    await c.service.vms.destroy(vm.vm.vm_id, actor);
  });

  it('layer garbage: LRU beyond ARTIFACT_MAX_PER_TENANT, idle past ARTIFACT_IDLE_TTL, never one a live VM seeds from', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const s = second!;
    const layers = ok(await c.request('GET', `/v1/snapshots?mode=build&state=ready`, { as: 'acme' })).snapshots.filter(
      (x: any) => x.layer_key === 'recipe:k1',
    );
    assert.equal(layers.length, 2);
    const [newer, older] = layers;
    // A cache hit is use: the layer it serves is the most recently used.
    const hit = await c.request('GET', `/v1/layers/recipe:k1?arch=${st.arch}`, { as: 'acme' });
    assert.equal(ok(hit).id, newer.id);
    const r1 = await s.snapshots.collect(new Date());
    assert.equal(r1.evicted, 1, JSON.stringify(r1));
    await eventually(
      async () => ok(await c.request('GET', `/v1/snapshots/${older.id}`, { as: 'acme' })).state === 'deleted',
      10_000,
      'older layer deleted',
    );
    assert.equal(ok(await c.request('GET', `/v1/snapshots/${newer.id}`, { as: 'acme' })).state, 'ready');
    const seeded = ok(await c.request('POST', '/v1/vms', { as: 'acme', body: { seed_snapshot_id: newer.id, cpus: 1, ram_mb: 256 } }), 201);
    await c.service.runner.waitFor(seeded.position, 10_000);
    const later = new Date(Date.now() + 2 * 3_600_000);
    assert.equal((await s.snapshots.collect(later)).idle, 0, 'a live VM seeds from it');
    const destroyed = ok(await c.request('DELETE', `/v1/vms/${seeded.id}`, { as: 'acme' }));
    await c.service.runner.waitFor(destroyed.position, 10_000);
    assert.equal((await s.snapshots.collect(later)).idle, 1);
    const evs = (await c.service.store.readStream(`snapshot-${newer.id}`))
      .filter((e) => e.type === 'SnapshotDeleted')
      .map((e) => (e.data as any).reason);
    assert.deepEqual(evs, ['idle']);
  });

  it('ARTIFACT_PULL_TIMEOUT bounds a move: the create fails with ARTIFACT_PULL_TIMEOUT and the failed move is an event', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const third = await startService({
      config: { ...c.config, ARTIFACT_PULL_TIMEOUT_MS: 1, RECONCILER_ENABLED: false },
      logger: pino({ level: 'silent' }),
      databaseUrl: c.db.url,
      tokenEncryptionKey: c.tokenKey,
      apiKeys: apiKeysFrom(ADMIN_KEY, []),
      defaultMetrics: false,
      httpLogger: false,
    });
    try {
      if (st.seeded) ok(await c.request('DELETE', `/v1/vms/${st.seeded}`, { as: 'acme' })); // room on h2
      const s2 = ok(await c.request('GET', `/v1/snapshots/${st.s2.id}`, { as: 'acme' }));
      assert.deepEqual(s2.holders, ['h1']);
      const actor: Actor = { correlationId: 'pull-timeout', actor: 'tenant:acme', tenantId: 'acme', admin: false };
      await assert.rejects(
        third.vms.create(parseVmSpec({ seed_snapshot_id: st.s2.id, host_id: 'h2', cpus: 1, ram_mb: 256 }), actor),
        (err: unknown) => {
          assert.ok(err instanceof AppError);
          assert.equal(err.code, 'ARTIFACT_PULL_TIMEOUT', err.message);
          assert.match(err.message, /ARTIFACT_PULL_TIMEOUT_MS=1/);
          return true;
        },
      );
      const evs = (await c.service.store.readStream(`snapshot-${st.s2.id}`)).map((e) => e.type);
      assert.equal(evs.at(-1), 'SnapshotArtifactMoveFailed');

      // A migration whose move times out stops at "move": the VM still runs where it was, and says so.
      const vm = ok(await c.request('GET', `/v1/vms/${st.vm}`, { as: 'acme' }));
      const r = await third.app.inject({
        method: 'POST',
        url: `/v1/vms/${st.vm}/migrate`,
        headers: { authorization: `Bearer ${ADMIN_KEY}`, 'content-type': 'application/json' },
        payload: '{}',
      });
      const body = r.json();
      assert.equal(r.statusCode, 504, JSON.stringify(body));
      assert.equal(body.code, 'MIGRATION_FAILED');
      assert.equal(body.details.step, 'move');
      assert.equal(body.details.cause_code, 'ARTIFACT_PULL_TIMEOUT');
      assert.match(body.detail, new RegExp(`still running on ${vm.host_id}`));
      const after = ok(await c.request('GET', `/v1/vms/${st.vm}`, { as: 'acme' }));
      assert.equal(after.host_id, vm.host_id);
      assert.equal((await exec(st.vm!, 'cat /root/marker')).stdout.trim(), 'hello-from-source');
      const types = (await c.service.store.readStream(`vm-${st.vm}`)).map((e) => e.type);
      assert.equal(types.at(-1), 'VmMigrationFailed');
    } finally {
      await third.close();
    }
  });

  it('retention: a snapshot past retention_until is collected (an event, then the agent delete)', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const s = ok(await c.request('POST', `/v1/vms/${st.vm}/snapshots`, { as: 'acme', body: { retention_s: 1, no_lineage: true } }), 201);
    await c.service.runner.waitFor(s.position, 10_000);
    const holder = agents[s.host_id === 'h1' ? 0 : 1]!;
    assert.ok((await holder.client.listCheckpoints()).some((cp) => cp.id === s.id));
    const early = await c.service.snapshots.collect(new Date());
    assert.equal(early.expired, 0);
    const r = await c.service.snapshots.collect(new Date(Date.now() + 2000));
    assert.ok(r.expired >= 1, JSON.stringify(r));
    const evs = (await c.service.store.readStream(`snapshot-${s.id}`)).map((e) => ({ type: e.type, reason: (e.data as any).reason }));
    assert.deepEqual(evs.slice(-2), [
      { type: 'SnapshotDeleted', reason: 'retention' },
      { type: 'SnapshotArtifactDropped', reason: undefined },
    ]);
    assert.ok(!(await holder.client.listCheckpoints()).some((cp) => cp.id === s.id));
  });

  it('a checkpoint the agent cannot take: the snapshot is failed with the reason and its quota slot released', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vm = ok(await c.request('POST', '/v1/vms', { as: 'acme', body: { host_id: 'h1', cpus: 1, ram_mb: 256 } }), 201);
    const before = ok(await c.request('GET', '/v1/snapshot-quota', { as: 'acme' }));
    await agents[0]!.client.destroyVm(`fl-${vm.id}`, { force: true }); // gone behind the control plane's back
    const r = await c.request('POST', `/v1/vms/${vm.id}/snapshots`, { as: 'acme', body: { comment: 'doomed' } });
    expectProblem(r, 404, 'SANDBOX_NOT_FOUND');
    const failed = await eventually(
      async () => {
        const rows = ok(await c.request('GET', `/v1/snapshots?vm_id=${vm.id}&state=failed`, { as: 'acme' })).snapshots;
        return rows.length === 1 ? rows[0] : undefined;
      },
      10_000,
      'failed snapshot listed',
    );
    assert.match(failed.last_error, /no sandbox named/);
    assert.deepEqual(ok(await c.request('GET', '/v1/snapshot-quota', { as: 'acme' })).count, before.count);
    await c.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' });
  });

  it('a rebuilt snapshots read model equals the live one', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const report = await rebuildProjection(c.service.store, c.service.pool, snapshotsProjection, { verify: true });
    assert.ok(report.events > 0);
    for (const d of report.drift)
      assert.deepEqual(
        { table: d.table, onlyLive: d.onlyLive, onlyRebuilt: d.onlyRebuilt },
        { table: d.table, onlyLive: 0, onlyRebuilt: 0 },
        JSON.stringify(d),
      );
  });
});
