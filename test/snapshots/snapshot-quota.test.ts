import assert from 'node:assert/strict';
import { readdir } from 'node:fs/promises';
import { join } from 'node:path';
import { after, before, describe, it, type TestContext } from 'node:test';
import type { RunningAgent } from '../agent/harness.js';
import {
  prepareAgents,
  problemOf,
  registerHost,
  startCheckedAgent,
  startControlPlane,
  type AgentFleet,
  type ControlPlane,
  type Reply,
} from '../support/control-plane.js';

/**
 * Disk and snapshot bytes through the API, with one real agent: storage_gb
 * reaches the sandbox as its own disk; a snapshot that would not fit the
 * tenant's byte quota is refused before the agent archives anything; build
 * snapshots are bounded by their own per-tenant limits.
 */

const MIB = 1024 * 1024;
const QUOTA = 8 * MIB;

function ok(r: Reply, status = 200): any {
  assert.equal(r.status, status, JSON.stringify(r.body));
  return r.body;
}
function refused(r: Reply, status: number, code: string): any {
  assert.equal(r.status, status, `expected ${status} ${code}, got ${r.status}: ${JSON.stringify(r.body)}`);
  assert.equal(problemOf(r).code, code, JSON.stringify(r.body));
  return r.body;
}

describe('disk quota and snapshot bytes (one real agent)', { timeout: 300_000 }, () => {
  let skip: string | undefined;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  let agent: RunningAgent | undefined;
  let vmId = '';

  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };
  const exec = async (cmd: string): Promise<{ exit_code: number; stdout: string; stderr: string }> =>
    ok(await cp!.request('POST', `/v1/vms/${vmId}/exec`, { as: 'acme', body: { argv: ['/bin/sh', '-c', cmd], timeout_ms: 120_000 } }));
  /** Archives the agent started for this VM, from its own request log. */
  const archiveCalls = (): number =>
    agent!
      .output()
      .split('\n')
      .filter((l) => l.includes('"method":"POST"') && l.includes(`/vms/fl-${vmId}/checkpoints`)).length;

  before(async () => {
    const prepared = await prepareAgents();
    if ('skip' in prepared) skip = prepared.skip;
    else {
      fleet = prepared;
      // Request logs (info) are how the tests see which calls reached the agent.
      const started = await startCheckedAgent(fleet, { env: { AGENT_LOG_LEVEL: 'info' } });
      if ('skip' in started) skip = started.skip;
      else agent = started;
    }
    if (skip) {
      process.stderr.write(`disk quota tests skipped: ${skip}\n`);
      return;
    }
    cp = await startControlPlane({
      env: {
        SNAPSHOT_QUOTA_MAX_BYTES: String(QUOTA),
        BUILD_SNAPSHOT_QUOTA_MAX_COUNT: '1',
        BUILD_SNAPSHOT_QUOTA_MAX_BYTES: String(QUOTA),
        RECONCILER_ENABLED: 'false',
        EXEC_DEFAULT_TIMEOUT_MS: '120000',
      },
    });
    ok(await registerHost(cp, 'h1', agent!), 201);
    vmId = ok(await cp.request('POST', '/v1/vms', { as: 'acme', body: { cpus: 1, ram_mb: 256, storage_gb: 1 } }), 201).id;
  });

  after(async () => {
    if (cp && vmId) await cp.request('DELETE', `/v1/vms/${vmId}`, { as: 'acme' }).catch(() => undefined);
    await cp?.close();
    await fleet?.close();
  });

  it('storage_gb reaches the sandbox: writing past it fails inside with ENOSPC', async (t) => {
    if (guard(t)) return;
    const r = await exec('dd if=/dev/zero of=/root/big bs=1M count=1200; echo "exit $?"; rm -f /root/big');
    assert.match(r.stderr, /No space left on device/, r.stderr);
    assert.match(r.stdout, /exit [1-9]/);
  });

  it('a snapshot that fits: its expected size is reserved first, then replaced by the real one', async (t) => {
    if (guard(t)) return;
    assert.equal((await exec('dd if=/dev/urandom of=/root/small bs=1M count=1 2>/dev/null && sync')).exit_code, 0);
    const s = ok(await cp!.request('POST', `/v1/vms/${vmId}/snapshots`, { as: 'acme', body: { no_lineage: true } }), 201);
    assert.equal(archiveCalls(), 1, 'the agent log shows the archive request (what the refusal below counts)');
    const events = (await cp!.service.store.readStream('tenant-acme')).filter((e) => (e.data as any).snapshot_id === s.id);
    assert.deepEqual(
      events.map((e) => e.type),
      ['SnapshotQuotaReserved', 'SnapshotQuotaSized'],
    );
    const expected = (events[0]!.data as any).expected_bytes as number;
    assert.ok(expected >= s.size_bytes && s.size_bytes > MIB, `expected ${expected} bounds the archive ${s.size_bytes}`);
    assert.equal((events[1]!.data as any).size_bytes, s.size_bytes);
    const usage = ok(await cp!.request('GET', '/v1/snapshot-quota', { as: 'acme' }));
    assert.equal(usage.bytes, s.size_bytes);
    assert.equal(usage.max_bytes, QUOTA);
  });

  it('a snapshot whose expected size exceeds the quota is refused with QUOTA_EXCEEDED before the agent archives anything', async (t) => {
    if (guard(t)) return;
    assert.equal((await exec('dd if=/dev/urandom of=/root/large bs=1M count=12 2>/dev/null && sync')).exit_code, 0);
    const held = (await agent!.client.listCheckpoints()).map((c) => c.id).sort();
    const calls = archiveCalls();
    const tenantBefore = (await cp!.service.store.readStream('tenant-acme')).length;
    const body = refused(
      await cp!.request('POST', `/v1/vms/${vmId}/snapshots`, { as: 'acme', body: { no_lineage: true } }),
      429,
      'QUOTA_EXCEEDED',
    );
    assert.equal(body.details.limit_kind, 'bytes');
    assert.ok(body.details.needed_bytes > 12 * MIB, JSON.stringify(body.details));
    assert.match(problemOf({ status: 429, body } as Reply).detail, /of 8388608 bytes in use, this one needs \d+/);
    assert.equal(archiveCalls(), calls, 'no checkpoint request reached the agent');
    assert.deepEqual((await agent!.client.listCheckpoints()).map((c) => c.id).sort(), held);
    assert.deepEqual(
      (await readdir(join(agent!.opts.dataDir, 'checkpoints'))).filter((e) => e.startsWith('.tmp-')),
      [],
    );
    assert.equal((await cp!.service.store.readStream('tenant-acme')).length, tenantBefore, 'nothing reserved');
    assert.equal((await exec('rm /root/large')).exit_code, 0);
  });

  it('an archive that outgrows its estimate is stopped at the quota headroom: QUOTA_EXCEEDED, snapshot failed, nothing kept, slot released', async (t) => {
    if (guard(t)) return;
    // Empty files under a ~4000-character path take no blocks but 5 KiB each in tar (a long-name header and the name):
    // the estimate (~2.5 MiB) passes, the archive (~10 MiB) does not fit the 8 MiB quota.
    const made = await exec(
      `d=/root/deep; for i in $(seq 1 15); do d="$d/$(printf 'd%.0s' $(seq 1 250))"; done; mkdir -p "$d" && cd "$d" && n=$(printf 'f%.0s' $(seq 1 200)); seq 1 2000 | sed "s/^/$n/" | xargs touch && echo made`,
    );
    assert.equal(made.stdout.trim(), 'made', made.stderr);
    const before = ok(await cp!.request('GET', '/v1/snapshot-quota', { as: 'acme' }));
    const held = (await agent!.client.listCheckpoints()).map((c) => c.id).sort();
    const calls = archiveCalls();
    const body = refused(
      await cp!.request('POST', `/v1/vms/${vmId}/snapshots`, { as: 'acme', body: { no_lineage: true } }),
      429,
      'QUOTA_EXCEEDED',
    );
    assert.equal(body.details.limit_kind, 'bytes');
    assert.equal(archiveCalls(), calls + 1, 'the agent started the archive and abandoned it');
    assert.deepEqual((await agent!.client.listCheckpoints()).map((c) => c.id).sort(), held, 'nothing kept on the agent');
    assert.deepEqual(
      (await readdir(join(agent!.opts.dataDir, 'checkpoints'))).filter((e) => e.startsWith('.tmp-')),
      [],
    );
    const after = ok(await cp!.request('GET', '/v1/snapshot-quota', { as: 'acme' }));
    assert.deepEqual([after.count, after.bytes], [before.count, before.bytes], 'the reservation was released');
    // The listing is a read model: the failure shows once its projection has it (a loaded CI host takes a moment).
    let failed: Array<{ last_error: string }> = [];
    for (let i = 0; i < 100 && failed.length === 0; i++) {
      if (i > 0) await new Promise((r) => setTimeout(r, 50));
      failed = ok(await cp!.request('GET', `/v1/snapshots?vm_id=${vmId}&state=failed`, { as: 'acme' })).snapshots;
    }
    assert.equal((await exec('rm -rf /root/deep')).exit_code, 0);
    assert.equal(failed.length, 1);
    assert.match(failed[0]!.last_error, /grew past/);
  });

  it('build snapshots are bounded per tenant by their own count and bytes; ordinary snapshots are not in that pool', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const l1 = ok(
      await c.request('POST', `/v1/vms/${vmId}/snapshots`, { as: 'acme', body: { mode: 'build', layer_key: 'quota:k1' } }),
      201,
    );
    const second = refused(
      await c.request('POST', `/v1/vms/${vmId}/snapshots`, { as: 'acme', body: { mode: 'build', layer_key: 'quota:k2' } }),
      429,
      'QUOTA_EXCEEDED',
    );
    assert.equal(second.details.pool, 'builds');
    assert.match(problemOf({ status: 429, body: second } as Reply).detail, /1 of 1 build snapshots/);
    const usage = ok(await c.request('GET', '/v1/snapshot-quota', { as: 'acme' }));
    assert.deepEqual(usage.builds, { count: 1, bytes: l1.size_bytes, max_count: 1, max_bytes: QUOTA });
    assert.equal(usage.count, 1, 'the snapshot pool holds only the ordinary snapshot');

    ok(await c.request('DELETE', `/v1/snapshots/${l1.id}`, { as: 'acme' }));
    assert.equal((await exec('dd if=/dev/urandom of=/root/layer bs=1M count=12 2>/dev/null && sync')).exit_code, 0);
    const calls = archiveCalls();
    const big = refused(
      await c.request('POST', `/v1/vms/${vmId}/snapshots`, { as: 'acme', body: { mode: 'build', layer_key: 'quota:k3' } }),
      429,
      'QUOTA_EXCEEDED',
    );
    assert.equal(big.details.limit_kind, 'bytes');
    assert.equal(archiveCalls(), calls, 'refused before archiving');
    assert.equal((await exec('rm /root/layer')).exit_code, 0);
    ok(await c.request('POST', `/v1/vms/${vmId}/snapshots`, { as: 'acme', body: { mode: 'build', layer_key: 'quota:k3' } }), 201);
  });
});
