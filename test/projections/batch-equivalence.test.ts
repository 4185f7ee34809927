import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { describe, it } from 'node:test';
import { hostsProjection } from '../../src/projections/hosts/hosts.projection.js';
import type { Projection } from '../../src/projections/projection.js';
import { rebuildProjection } from '../../src/projections/rebuild.js';
import { vmsProjection } from '../../src/projections/vms/vms.projection.js';
import { databaseFor } from './database.js';

/**
 * The hosts and vms read models fold a run of events in memory and write the
 * result at once. A history full of the awkward cases — a re-registration, a
 * reservation released and made again, a deregistration wiping holds and a
 * host coming back, events for a VM never requested, an activity older than
 * the last, a migration, a failure — applied one event per transaction must
 * give exactly the rows that a rebuild in pages of thousands gives
 * (`rebuildProjection` verify compares them row by row).
 */
describe('read models: one event at a time equals a run at once', { timeout: 60_000 }, () => {
  const setup = databaseFor('batcheq', [hostsProjection, vmsProjection]);

  it('hosts and vms', async () => {
    const [db, store] = [setup.db(), setup.store()];
    const t = (s: number): string => new Date(Date.UTC(2026, 11, 2, 10, 0, s)).toISOString();
    const cap = { cpus: 8, ram_mb: 16384, storage_gb: 100, vm_count: 10, arch: 'amd64' };
    const reg = (host: string, s: number, url = `http://127.0.0.1:7070`) => ({
      type: 'HostRegistered',
      data: {
        host_id: host,
        url,
        region: 'r',
        backend: 'process',
        labels: { zone: 'a' },
        capacity: cap,
        probed_capacity: cap,
        overrides: {},
        token_encrypted: 'v1.x.y.z',
        at: t(s),
      },
    });
    const hold = (host: string, vm: string, s: number, type: 'CapacityReserved' | 'CapacityReleased', cpus = 2) => ({
      type,
      data: { host_id: host, vm_id: vm, cpus, ram_mb: 1024, storage_gb: 5, gpus: 0, gpu_uuids: [], mig_instance_uuids: [], at: t(s) },
    });
    const decision = (host: string) => ({
      host_id: host,
      policy: 'spread',
      candidates: 2,
      headroom_cpus: 4,
      headroom_ram: 8192,
      artifact_local: false,
      artifact_holders: 0,
    });
    const reservation = { cpus: 2, ram_mb: 1024, storage_gb: 5, gpus: 0, gpu_uuids: [], mig_instance_uuids: [] };
    const spec = { cpus: 2, ram_mb: 1024, storage_gb: 5, gpus: 0 };
    const h1 = `h1-${randomUUID().slice(0, 8)}`;
    const h2 = `h2-${randomUUID().slice(0, 8)}`;
    const v1 = randomUUID().replace(/-/g, '').slice(0, 24);
    const v2 = randomUUID().replace(/-/g, '').slice(0, 24);
    const ghost = randomUUID().replace(/-/g, '').slice(0, 24);
    const history: Array<[string, Array<{ type: string; data: unknown }>]> = [
      [
        `host-${h1}`,
        [
          reg(h1, 1),
          hold(h1, v1, 2, 'CapacityReserved'),
          hold(h1, v2, 3, 'CapacityReserved', 3),
          { type: 'HostCordoned', data: { host_id: h1, at: t(4) } },
        ],
      ],
      [
        `vm-${v1}`,
        [
          { type: 'VmRequested', data: { vm_id: v1, spec, tenant_id: 'acme', at: t(2) } },
          { type: 'VmPlaced', data: { vm_id: v1, host_id: h1, decision: decision(h1), reservation, at: t(3) } },
          { type: 'VmBootStarted', data: { vm_id: v1, host_id: h1, at: t(3) } },
          {
            type: 'VmBooted',
            data: {
              vm_id: v1,
              url: 'http://10.0.0.2',
              endpoints: [{ as: 'http', url: 'http://127.0.0.1:30000', port: 80, protocol: 'tcp' }],
              boot_ms: 120,
              at: t(4),
            },
          },
          { type: 'VmActivityRecorded', data: { vm_id: v1, at: t(20) } },
          { type: 'VmActivityRecorded', data: { vm_id: v1, at: t(10) } },
          {
            type: 'VmMigrated',
            data: {
              vm_id: v1,
              from_host_id: h1,
              host_id: h2,
              decision: decision(h2),
              reservation,
              snapshot_id: 's1',
              url: 'http://10.0.0.9',
              endpoints: [],
              at: t(30),
            },
          },
        ],
      ],
      [`vm-${ghost}`, [{ type: 'VmBooted', data: { vm_id: ghost, url: 'u', endpoints: [], boot_ms: 1, at: t(5) } }]],
      [`host-${h2}`, [reg(h2, 5), hold(h2, v1, 29, 'CapacityReserved')]],
      [
        `host-${h1}`,
        [
          hold(h1, v2, 31, 'CapacityReleased', 3),
          hold(h1, v2, 32, 'CapacityReserved', 3),
          hold(h1, v1, 33, 'CapacityReleased'),
          hold(h1, v1, 34, 'CapacityReleased'),
          { type: 'HostMarkedUnreachable', data: { host_id: h1, reason: 'timeout', at: t(35) } },
          { type: 'HostDeregistered', data: { host_id: h1, forced: true, released_vm_ids: [v2], at: t(36) } },
          reg(h1, 37, 'http://127.0.0.1:9999'),
          hold(h1, v2, 38, 'CapacityReserved', 1),
          {
            type: 'HostCapacityProbed',
            data: { host_id: h1, capacity: { ...cap, cpus: 16 }, probed_capacity: { ...cap, cpus: 16 }, at: t(39) },
          },
        ],
      ],
      [
        `vm-${v2}`,
        [
          { type: 'VmRequested', data: { vm_id: v2, spec, tenant_id: 'beta', task_id: 'task-1', idempotency_key: 'k', at: t(3) } },
          { type: 'VmRequested', data: { vm_id: v2, spec: { ...spec, cpus: 9 }, tenant_id: 'other', at: t(4) } },
          {
            type: 'VmFailed',
            data: {
              vm_id: v2,
              reason: 'boot_failure',
              error: 'startup script exited 3',
              error_code: 'STARTUP_SCRIPT_FAILED',
              phase: 'booting',
              at: t(40),
            },
          },
        ],
      ],
    ];
    for (const [stream, events] of history) {
      const head = (await store.readStream(stream)).at(-1)?.revision;
      await store.append(
        stream,
        events.map((e) => ({ id: randomUUID(), ...e })),
        head === undefined ? 'no_stream' : head,
      );
    }
    const all = await store.readAll();
    for (const p of [hostsProjection, vmsProjection] as Projection[]) {
      // The live tables: one event per transaction, through apply().
      for (const e of all) {
        const client = await db.pool.connect();
        try {
          await client.query('BEGIN');
          await p.apply(client, e);
          await client.query(
            `INSERT INTO projection_checkpoints (name, position) VALUES ($1, $2) ON CONFLICT (name) DO UPDATE SET position = $2`,
            [p.name, e.position],
          );
          await client.query('COMMIT');
        } finally {
          client.release();
        }
      }
      const report = await rebuildProjection(store, db.pool, p, { verify: true });
      assert.equal(report.events, all.length);
      for (const d of report.drift)
        assert.deepEqual(
          { table: d.table, onlyLive: d.onlyLive, onlyRebuilt: d.onlyRebuilt },
          { table: d.table, onlyLive: 0, onlyRebuilt: 0 },
          `${p.name}: ${d.table} drifted (${d.sampleKeys.join(', ')})`,
        );
    }
    // And the fold got the awkward cases right, not merely the same twice.
    const host1 = (await db.pool.query('SELECT state, url, allocated_cpus, allocated_vms, capacity FROM hosts WHERE id = $1', [h1]))
      .rows[0];
    assert.deepEqual(
      { state: host1.state, url: host1.url, cpus: host1.allocated_cpus, vms: host1.allocated_vms, capCpus: host1.capacity.cpus },
      { state: 'active', url: 'http://127.0.0.1:9999', cpus: 1, vms: 1, capCpus: 16 },
    );
    const holds = (await db.pool.query('SELECT host_id, vm_id FROM host_reservations ORDER BY host_id, vm_id')).rows.map(
      (r) => `${r.host_id}/${r.vm_id}`,
    );
    assert.deepEqual(holds, [`${h1}/${v2}`, `${h2}/${v1}`].sort());
    const vm1 = (await db.pool.query('SELECT state, host_id, url, last_activity_at FROM vms WHERE id = $1', [v1])).rows[0];
    // Boot counts as activity at its commit time; the older of two activity records never wins.
    const booted = all.find((e) => e.streamId === `vm-${v1}` && e.type === 'VmBooted')!.created.toISOString();
    const activity = booted > t(20) ? booted : t(20);
    assert.deepEqual(
      { state: vm1.state, host: vm1.host_id, url: vm1.url, activity: vm1.last_activity_at.toISOString() },
      { state: 'running', host: h2, url: 'http://10.0.0.9', activity },
    );
    const vm2 = (await db.pool.query('SELECT state, tenant_id, error_code, failed_phase FROM vms WHERE id = $1', [v2])).rows[0];
    assert.deepEqual(vm2, { state: 'failed', tenant_id: 'beta', error_code: 'STARTUP_SCRIPT_FAILED', failed_phase: 'booting' });
    assert.equal((await db.pool.query('SELECT count(*)::int AS n FROM vms WHERE id = $1', [ghost])).rows[0].n, 0);
  });
});
