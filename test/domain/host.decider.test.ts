import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import type { HostCapacity } from '@fleet/agent-protocol';
import { fold } from '../../src/domain/decider.js';
import { AppError } from '@fleet/agent-protocol';
import {
  hostAllocation,
  hostDecider,
  type HostCommand,
  type HostState,
  type RegisterHostData,
} from '../../src/domain/host/host.decider.js';
import { parseHostEvent, type HostEvent } from '../../src/domain/host/host.events.js';
import { at, given, T0 } from './gwt.js';

const NOW = T0.toISOString();

function cap(over: Partial<HostCapacity> = {}): HostCapacity {
  return { cpus: 8, ram_mb: 16384, storage_gb: 100, vm_count: 4, arch: 'amd64', ...over };
}

function registration(over: Partial<RegisterHostData> = {}): HostCommand {
  return {
    type: 'RegisterHost',
    data: {
      host_id: 'h1',
      url: 'http://10.0.0.1:7070',
      region: 'eu',
      backend: 'process',
      labels: { zone: 'a' },
      probed_capacity: cap(),
      token_encrypted: 'v1.iv.ct.tag',
      ...over,
    },
  };
}

/** Runs commands in order through the decider, returning every event: the "given" history built by the code under test. */
function history(...commands: HostCommand[]): HostEvent[] {
  const events: HostEvent[] = [];
  let state: HostState = hostDecider.initialState;
  for (const c of commands) {
    const out = hostDecider.decide(c, state, { now: T0 });
    for (const e of out) state = hostDecider.evolve(state, e);
    events.push(...out);
  }
  return events;
}

const reserve = (vm_id: string, over: Partial<Extract<HostCommand, { type: 'ReserveCapacity' }>['data']> = {}): HostCommand => ({
  type: 'ReserveCapacity',
  data: { host_id: 'h1', vm_id, cpus: 2, ram_mb: 4096, storage_gb: 10, ...over },
});
const release = (vm_id: string): HostCommand => ({ type: 'ReleaseCapacity', data: { host_id: 'h1', vm_id } });

describe('host: registration', () => {
  test('registers with overrides applied over the probe, the encrypted token passed through', () => {
    given(hostDecider)
      .when(registration({ overrides: { cpus: 4, vm_count: 10 } }))
      .then([
        {
          type: 'HostRegistered',
          data: {
            host_id: 'h1',
            url: 'http://10.0.0.1:7070',
            region: 'eu',
            backend: 'process',
            labels: { zone: 'a' },
            capacity: cap({ cpus: 4, vm_count: 10 }),
            probed_capacity: cap(),
            overrides: { cpus: 4, vm_count: 10 },
            token_encrypted: 'v1.iv.ct.tag',
            at: NOW,
          },
        },
      ]);
  });

  test('events round-trip through their zod schema', () => {
    for (const e of history(registration(), reserve('v1'), release('v1')))
      assert.deepEqual(parseHostEvent(e.type, JSON.parse(JSON.stringify(e.data))), e);
  });

  test('registering again at the same url is a no-op; another url is HOST_ALREADY_REGISTERED', () => {
    given(hostDecider, history(registration())).when(registration()).then([]);
    given(hostDecider, history(registration()))
      .when(registration({ url: 'http://10.0.0.2:7070' }))
      .thenThrows('HOST_ALREADY_REGISTERED', 409);
  });

  test('a deregistered host may register afresh, with no reservations', () => {
    const state = given(hostDecider, history(registration(), { type: 'DeregisterHost', data: { host_id: 'h1' } }))
      .when(registration({ url: 'http://10.0.0.9:7070' }))
      .thenState();
    assert.equal(state.status, 'active');
    assert.equal(hostAllocation(state).vm_count, 0);
  });

  test('bad registration data is VALIDATION_FAILED naming the field', () => {
    const err = given(hostDecider)
      .when(registration({ url: 'not a url' }))
      .thenThrows('VALIDATION_FAILED', 400, /url/);
    assert.deepEqual(
      (err.details?.['fields'] as Array<{ path: string }>).map((f) => f.path),
      ['url'],
    );
  });

  test('only qemu hosts may have GPUs or MIG instances', () => {
    given(hostDecider)
      .when(registration({ probed_capacity: cap({ gpus: 2, gpu_kind: 'a100' }) }))
      .thenThrows('HOST_GPU_REQUIRES_QEMU', 400, /qemu/);
    given(hostDecider)
      .when(registration({ backend: 'firecracker', overrides: { mig_profiles: { '1g.10gb': 2 } } }))
      .thenThrows('HOST_GPU_REQUIRES_QEMU', 400);
    given(hostDecider)
      .when(registration({ backend: 'firecracker', probed_capacity: cap({ gpu_devices: [{ uuid: 'GPU-1' }] }) }))
      .thenThrows('HOST_GPU_REQUIRES_QEMU');
    const [e] = given(hostDecider)
      .when(registration({ backend: 'qemu', probed_capacity: cap({ gpus: 2, gpu_kind: 'a100' }) }))
      .events();
    assert.equal(e?.type, 'HostRegistered');
  });

  test('inventory defines the counters: gpus from devices (MIG-mode cards excluded), mig_profiles from instances', () => {
    const [e] = given(hostDecider)
      .when(
        registration({
          backend: 'qemu',
          probed_capacity: cap({
            gpus: 7,
            gpu_kind: 'a100',
            gpu_devices: [{ uuid: 'GPU-1' }, { uuid: 'GPU-2' }, { uuid: 'GPU-M', mig_mode: 'Enabled' }],
            mig_instances: [
              { uuid: 'MIG-1', profile: '1g.10gb', parent_gpu_uuid: 'GPU-M' },
              { uuid: 'MIG-2', profile: '1g.10gb', parent_gpu_uuid: 'GPU-M' },
              { uuid: 'MIG-3', profile: '3g.40gb', parent_gpu_uuid: 'GPU-M' },
            ],
          }),
        }),
      )
      .events();
    assert.ok(e?.type === 'HostRegistered');
    assert.equal(e.data.capacity.gpus, 2);
    assert.deepEqual(e.data.capacity.mig_profiles, { '1g.10gb': 2, '3g.40gb': 1 });
  });

  test('an override of a counter the inventory defines is refused, not ignored', () => {
    given(hostDecider)
      .when(registration({ backend: 'qemu', probed_capacity: cap({ gpu_devices: [{ uuid: 'GPU-1' }] }), overrides: { gpus: 4 } }))
      .thenThrows('VALIDATION_FAILED', 400, /gpu_devices|whole GPU/);
  });
});

describe('host: probe, cordon, reachability', () => {
  test('a probe that changes nothing is a no-op; a changed one re-applies the registration overrides', () => {
    const g = given(hostDecider, history(registration({ overrides: { cpus: 4 } })));
    g.when({ type: 'ProbeHostCapacity', data: { host_id: 'h1', probed_capacity: cap() } }, at(60)).then([]);
    g.when({ type: 'ProbeHostCapacity', data: { host_id: 'h1', probed_capacity: cap({ ram_mb: 32768 }) } }, at(60)).then([
      {
        type: 'HostCapacityProbed',
        data: {
          host_id: 'h1',
          capacity: cap({ cpus: 4, ram_mb: 32768 }),
          probed_capacity: cap({ ram_mb: 32768 }),
          at: at(60).toISOString(),
        },
      },
    ]);
  });

  test('a probe that reports GPUs on a non-qemu host is refused like a registration', () => {
    given(hostDecider, history(registration()))
      .when({ type: 'ProbeHostCapacity', data: { host_id: 'h1', probed_capacity: cap({ gpu_devices: [{ uuid: 'GPU-1' }] }) } })
      .thenThrows('HOST_GPU_REQUIRES_QEMU', 400);
  });

  test('a probe of an unregistered host is HOST_NOT_FOUND; of a deregistered one HOST_DEREGISTERED', () => {
    given(hostDecider)
      .when({ type: 'ProbeHostCapacity', data: { host_id: 'h1', probed_capacity: cap() } })
      .thenThrows('HOST_NOT_FOUND', 404);
    given(hostDecider, history(registration(), { type: 'DeregisterHost', data: { host_id: 'h1' } }))
      .when({ type: 'ProbeHostCapacity', data: { host_id: 'h1', probed_capacity: cap() } })
      .thenThrows('HOST_DEREGISTERED', 409);
  });

  test('cordon and uncordon are idempotent', () => {
    const reg = history(registration());
    given(hostDecider, reg)
      .when({ type: 'CordonHost', data: { host_id: 'h1', reason: 'maintenance' } })
      .then([{ type: 'HostCordoned', data: { host_id: 'h1', reason: 'maintenance', at: NOW } }]);
    const cordoned = history(registration(), { type: 'CordonHost', data: { host_id: 'h1' } });
    given(hostDecider, cordoned)
      .when({ type: 'CordonHost', data: { host_id: 'h1' } })
      .then([]);
    given(hostDecider, reg)
      .when({ type: 'UncordonHost', data: { host_id: 'h1' } })
      .then([]);
    given(hostDecider, cordoned)
      .when({ type: 'UncordonHost', data: { host_id: 'h1' } })
      .then([{ type: 'HostUncordoned', data: { host_id: 'h1', at: NOW } }]);
  });

  test('unreachable outranks cordoned, and reachability restores the cordon', () => {
    const h = history(
      registration(),
      { type: 'CordonHost', data: { host_id: 'h1' } },
      { type: 'MarkHostUnreachable', data: { host_id: 'h1', reason: 'probe timed out' } },
    );
    assert.equal(fold(hostDecider, h).status, 'unreachable');
    given(hostDecider, h)
      .when({ type: 'MarkHostUnreachable', data: { host_id: 'h1', reason: 'again' } })
      .then([]);
    assert.equal(
      given(hostDecider, h)
        .when({ type: 'MarkHostReachable', data: { host_id: 'h1' } })
        .thenState().status,
      'cordoned',
    );
    given(hostDecider, history(registration()))
      .when({ type: 'MarkHostReachable', data: { host_id: 'h1' } })
      .then([]);
  });
});

describe('host: capacity reservations', () => {
  test('a reservation that fits is recorded; allocation is derived from it', () => {
    const g = given(hostDecider, history(registration()));
    g.when(reserve('v1')).then([
      {
        type: 'CapacityReserved',
        data: {
          vm_id: 'v1',
          cpus: 2,
          ram_mb: 4096,
          storage_gb: 10,
          gpus: 0,
          gpu_uuids: [],
          mig_instance_uuids: [],
          host_id: 'h1',
          at: NOW,
        },
      },
    ]);
    const alloc = hostAllocation(g.when(reserve('v1')).thenState());
    assert.deepEqual(alloc, {
      cpus: 2,
      ram_mb: 4096,
      storage_gb: 10,
      vm_count: 1,
      gpus: 0,
      mig_profiles: {},
      gpu_device_uuids: [],
      mig_instance_uuids: [],
    });
  });

  test('a second reservation for the same vm is an idempotent retry: no event, even once cordoned', () => {
    given(hostDecider, history(registration(), reserve('v1')))
      .when(reserve('v1'))
      .then([]);
    given(hostDecider, history(registration(), reserve('v1'), { type: 'CordonHost', data: { host_id: 'h1' } }))
      .when(reserve('v1'))
      .then([]);
  });

  test('a reservation that does not fit is HOST_CAPACITY_EXHAUSTED saying what is short', () => {
    const err = given(hostDecider, history(registration(), reserve('v1', { ram_mb: 14336 })))
      .when(reserve('v2', { cpus: 7, ram_mb: 4096 }))
      .thenThrows('HOST_CAPACITY_EXHAUSTED', 409, /short of CPUs \(need 7, free 6\), short of RAM \(need 4096 MB, free 2048\)/);
    assert.deepEqual(err.details?.['short'], [
      { resource: 'cpus', need: 7, free: 6 },
      { resource: 'ram_mb', need: 4096, free: 2048 },
    ]);
  });

  test('the VM count limit is a capacity like any other', () => {
    const h = history(
      registration({ overrides: { vm_count: 2 } }),
      reserve('v1', { cpus: 1, ram_mb: 1 }),
      reserve('v2', { cpus: 1, ram_mb: 1 }),
    );
    given(hostDecider, h)
      .when(reserve('v3', { cpus: 1, ram_mb: 1 }))
      .thenThrows('HOST_CAPACITY_EXHAUSTED', 409, /VM slot/);
  });

  test('no reservation on a cordoned, unreachable, deregistered or unknown host', () => {
    given(hostDecider, history(registration(), { type: 'CordonHost', data: { host_id: 'h1' } }))
      .when(reserve('v1'))
      .thenThrows('HOST_CORDONED', 409);
    given(hostDecider, history(registration(), { type: 'MarkHostUnreachable', data: { host_id: 'h1', reason: 'x' } }))
      .when(reserve('v1'))
      .thenThrows('HOST_UNREACHABLE', 409);
    given(hostDecider, history(registration(), { type: 'DeregisterHost', data: { host_id: 'h1' } }))
      .when(reserve('v1'))
      .thenThrows('HOST_DEREGISTERED', 409);
    given(hostDecider).when(reserve('v1')).thenThrows('HOST_NOT_FOUND', 404);
  });

  test('gpu_kind or gpu_profile without gpus is refused', () => {
    given(hostDecider, history(registration()))
      .when(reserve('v1', { gpu_kind: 'a100' }))
      .thenThrows('VALIDATION_FAILED', 400, /gpus > 0/);
  });

  test('release records what was held; releasing twice, or a vm never reserved, yields no event', () => {
    const h = history(registration(), reserve('v1'));
    const [e] = given(hostDecider, h).when(release('v1')).events();
    assert.equal(e?.type, 'CapacityReleased');
    assert.equal(e?.data.vm_id, 'v1');
    assert.equal(e?.data.ram_mb, 4096);
    given(hostDecider, history(registration(), reserve('v1'), release('v1')))
      .when(release('v1'))
      .then([]);
    given(hostDecider, history(registration())).when(release('v9')).then([]);
    assert.deepEqual(hostAllocation(fold(hostDecider, history(registration(), reserve('v1'), release('v1')))).cpus, 0);
  });

  test('release is allowed on a cordoned or unreachable host', () => {
    const h = history(
      registration(),
      reserve('v1'),
      { type: 'CordonHost', data: { host_id: 'h1' } },
      { type: 'MarkHostUnreachable', data: { host_id: 'h1', reason: 'x' } },
    );
    assert.equal(given(hostDecider, h).when(release('v1')).events().length, 1);
  });
});

describe('host: deregistration', () => {
  test('refused while it holds VMs unless forced; forced drops the reservations; twice is a no-op', () => {
    const h = history(registration(), reserve('v2'), reserve('v1'));
    const err = given(hostDecider, h)
      .when({ type: 'DeregisterHost', data: { host_id: 'h1' } })
      .thenThrows('HOST_HAS_VMS', 409, /2 VM\(s\) \(v1, v2\)/);
    assert.deepEqual(err.details?.['vm_ids'], ['v1', 'v2']);
    const g = given(hostDecider, h).when({ type: 'DeregisterHost', data: { host_id: 'h1', force: true } });
    g.then([{ type: 'HostDeregistered', data: { host_id: 'h1', forced: true, released_vm_ids: ['v1', 'v2'], at: NOW } }]);
    const after = g.thenState();
    assert.equal(after.status, 'deregistered');
    assert.equal(hostAllocation(after).vm_count, 0);
    given(hostDecider, [...h, ...g.events()])
      .when({ type: 'DeregisterHost', data: { host_id: 'h1' } })
      .then([]);
    given(hostDecider, [...h, ...g.events()])
      .when(release('v1'))
      .then([]);
  });

  test('an empty host deregisters without force', () => {
    given(hostDecider, history(registration(), reserve('v1'), release('v1')))
      .when({ type: 'DeregisterHost', data: { host_id: 'h1' } })
      .then([{ type: 'HostDeregistered', data: { host_id: 'h1', forced: false, released_vm_ids: [], at: NOW } }]);
  });
});

describe('host: GPU and MIG binding', () => {
  const gpuHost = (over: Partial<HostCapacity> = {}): HostCommand =>
    registration({
      backend: 'qemu',
      probed_capacity: cap({
        gpu_kind: 'a100',
        gpu_devices: [{ uuid: 'GPU-A' }, { uuid: 'GPU-M', mig_mode: 'enabled' }, { uuid: 'GPU-B' }, { uuid: 'GPU-C' }],
        mig_instances: [
          { uuid: 'MIG-1', profile: '1g.10gb', parent_gpu_uuid: 'GPU-M' },
          { uuid: 'MIG-2', profile: '1g.10gb', parent_gpu_uuid: 'GPU-M' },
          { uuid: 'MIG-3', profile: '1g.10gb', kind: 'h100', parent_gpu_uuid: 'GPU-X' },
        ],
        ...over,
      }),
    });
  const gpu = (vm: string, n: number, extra: Record<string, unknown> = {}): HostCommand =>
    reserve(vm, { cpus: 1, ram_mb: 512, storage_gb: 1, gpus: n, gpu_kind: 'a100', ...extra });

  test('binds the first free device uuids in inventory order, skipping MIG-mode cards and bound devices', () => {
    const [e1] = given(hostDecider, history(gpuHost())).when(gpu('v1', 2)).events();
    assert.ok(e1?.type === 'CapacityReserved');
    assert.deepEqual(e1.data.gpu_uuids, ['GPU-A', 'GPU-B']);
    const [e2] = given(hostDecider, history(gpuHost(), gpu('v1', 2)))
      .when(gpu('v2', 1))
      .events();
    assert.ok(e2?.type === 'CapacityReserved');
    assert.deepEqual(e2.data.gpu_uuids, ['GPU-C']);
    const state = fold(hostDecider, history(gpuHost(), gpu('v1', 2), gpu('v2', 1)));
    assert.deepEqual(hostAllocation(state).gpu_device_uuids.sort(), ['GPU-A', 'GPU-B', 'GPU-C']);
    assert.equal(hostAllocation(state).gpus, 3);
    given(hostDecider, history(gpuHost(), gpu('v1', 2), gpu('v2', 1)))
      .when(gpu('v3', 1))
      .thenThrows('HOST_CAPACITY_EXHAUSTED', 409, /short of a100 GPUs \(need 1, free 0\)/);
  });

  test('a released device is free to bind again', () => {
    const [e] = given(hostDecider, history(gpuHost(), gpu('v1', 3), release('v1')))
      .when(gpu('v2', 1))
      .events();
    assert.ok(e?.type === 'CapacityReserved');
    assert.deepEqual(e.data.gpu_uuids, ['GPU-A']);
  });

  test('uuids chosen by placement are bound as given, and refused when unknown, bound, in MIG mode or duplicated', () => {
    const [e] = given(hostDecider, history(gpuHost()))
      .when(gpu('v1', 1, { gpu_uuids: ['GPU-C'] }))
      .events();
    assert.ok(e?.type === 'CapacityReserved');
    assert.deepEqual(e.data.gpu_uuids, ['GPU-C']);
    const h = history(gpuHost(), gpu('v1', 1, { gpu_uuids: ['GPU-C'] }));
    given(hostDecider, h)
      .when(gpu('v2', 1, { gpu_uuids: ['GPU-C'] }))
      .thenThrows('GPU_BINDING_UNAVAILABLE', 409, /GPU-C/);
    given(hostDecider, h)
      .when(gpu('v2', 1, { gpu_uuids: ['GPU-M'] }))
      .thenThrows('GPU_BINDING_UNAVAILABLE');
    given(hostDecider, h)
      .when(gpu('v2', 1, { gpu_uuids: ['GPU-Z'] }))
      .thenThrows('GPU_BINDING_UNAVAILABLE');
    given(hostDecider, h)
      .when(gpu('v2', 2, { gpu_uuids: ['GPU-A', 'GPU-A'] }))
      .thenThrows('GPU_BINDING_UNAVAILABLE');
  });

  test('the wrong GPU kind does not fit', () => {
    given(hostDecider, history(gpuHost()))
      .when(gpu('v1', 1, { gpu_kind: 'h100' }))
      .thenThrows('HOST_CAPACITY_EXHAUSTED', 409, /h100 GPUs/);
  });

  test('count-only hosts count whole GPUs and bind no uuids', () => {
    const h = history(registration({ backend: 'qemu', probed_capacity: cap({ gpus: 2, gpu_kind: 'a100' }) }));
    const [e] = given(hostDecider, h).when(gpu('v1', 2)).events();
    assert.ok(e?.type === 'CapacityReserved');
    assert.deepEqual(e.data.gpu_uuids, []);
    assert.equal(e.data.gpus, 2);
    given(hostDecider, [...h, e])
      .when(gpu('v2', 1))
      .thenThrows('HOST_CAPACITY_EXHAUSTED', 409, /free 0/);
    given(hostDecider, h)
      .when(gpu('v2', 1, { gpu_uuids: ['GPU-1'] }))
      .thenThrows('GPU_BINDING_UNAVAILABLE');
  });

  test('MIG: binds free instances of the profile on a kind-matching parent', () => {
    const mig = (vm: string, n: number, extra: Record<string, unknown> = {}): HostCommand =>
      gpu(vm, n, { gpu_profile: '1g.10gb', ...extra });
    const [e] = given(hostDecider, history(gpuHost())).when(mig('v1', 2)).events();
    assert.ok(e?.type === 'CapacityReserved');
    assert.deepEqual(e.data.mig_instance_uuids, ['MIG-1', 'MIG-2']);
    assert.deepEqual(e.data.gpu_uuids, []);
    // MIG-3 is 1g.10gb too, but its parent is an h100.
    given(hostDecider, history(gpuHost(), mig('v1', 2)))
      .when(mig('v2', 1))
      .thenThrows('HOST_CAPACITY_EXHAUSTED', 409, /short of MIG 1g.10gb \(a100\) instances \(need 1, free 0\)/);
    const [h100] = given(hostDecider, history(gpuHost(), mig('v1', 2)))
      .when(mig('v2', 1, { gpu_kind: 'h100' }))
      .events();
    assert.ok(h100?.type === 'CapacityReserved');
    assert.deepEqual(h100.data.mig_instance_uuids, ['MIG-3']);
    // Whole devices and MIG instances are independent pools.
    const state = fold(hostDecider, history(gpuHost(), mig('v1', 2), gpu('v2', 3)));
    assert.deepEqual(hostAllocation(state).mig_profiles, { '1g.10gb': 2 });
    assert.deepEqual(hostAllocation(state).mig_instance_uuids, ['MIG-1', 'MIG-2']);
    given(hostDecider, history(gpuHost()))
      .when(mig('v1', 1, { mig_instance_uuids: ['MIG-3'] }))
      .thenThrows('GPU_BINDING_UNAVAILABLE');
  });

  test('MIG by profile count on hosts without instance inventory', () => {
    const h = history(
      registration({ backend: 'qemu', probed_capacity: cap({ gpu_kind: 'a100' }), overrides: { mig_profiles: { '1g.10gb': 3 } } }),
    );
    const mig = (vm: string, n: number): HostCommand => gpu(vm, n, { gpu_profile: '1g.10gb' });
    const [e] = given(hostDecider, h).when(mig('v1', 2)).events();
    assert.ok(e?.type === 'CapacityReserved');
    assert.deepEqual(e.data.mig_instance_uuids, []);
    given(hostDecider, [...h, e])
      .when(mig('v2', 2))
      .thenThrows('HOST_CAPACITY_EXHAUSTED', 409, /need 2, free 1/);
    given(hostDecider, h)
      .when(gpu('v2', 1, { gpu_profile: '2g.20gb' }))
      .thenThrows('HOST_CAPACITY_EXHAUSTED');
  });
});

describe('host: property — random reserve/release never over-commits', () => {
  /** mulberry32: a seeded PRNG so a failure reproduces. */
  function rng(seed: number): () => number {
    let a = seed >>> 0;
    return () => {
      a = (a + 0x6d2b79f5) >>> 0;
      let t = a;
      t = Math.imul(t ^ (t >>> 15), t | 1);
      t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
      return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    };
  }

  for (const seed of [1, 2, 3, 42, 2026]) {
    test(`seed ${seed}: 1500 random operations`, () => {
      const r = rng(seed);
      const pick = <X>(xs: readonly X[]): X => xs[Math.floor(r() * xs.length)]!;
      let state = fold(
        hostDecider,
        history(
          registration({
            backend: 'qemu',
            probed_capacity: cap({
              cpus: 16,
              ram_mb: 32768,
              storage_gb: 200,
              vm_count: 6,
              gpu_kind: 'a100',
              gpu_devices: [{ uuid: 'G1' }, { uuid: 'G2' }, { uuid: 'G3' }],
              mig_instances: [
                { uuid: 'M1', profile: '1g.10gb' },
                { uuid: 'M2', profile: '1g.10gb' },
                { uuid: 'M3', profile: '2g.20gb' },
              ],
            }),
          }),
        ),
      );
      const vms = Array.from({ length: 12 }, (_, i) => `v${i}`);
      let reserved = 0;
      let refused = 0;
      for (let i = 0; i < 1500; i++) {
        const vm = pick(vms);
        let command: HostCommand;
        if (r() < 0.55) {
          const kind = r();
          const gpus = kind < 0.6 ? 0 : 1 + Math.floor(r() * 2);
          command = reserve(vm, {
            cpus: 1 + Math.floor(r() * 6),
            ram_mb: 256 * (1 + Math.floor(r() * 32)),
            storage_gb: 1 + Math.floor(r() * 60),
            gpus,
            ...(gpus > 0 ? { gpu_kind: 'a100' } : {}),
            ...(gpus > 0 && kind > 0.8 ? { gpu_profile: pick(['1g.10gb', '2g.20gb']) } : {}),
          });
        } else {
          command = release(vm);
        }
        let events: HostEvent[] = [];
        try {
          events = hostDecider.decide(command, state, { now: at(i) });
        } catch (e) {
          assert.ok(e instanceof AppError && e.code === 'HOST_CAPACITY_EXHAUSTED', `unexpected ${String(e)}`);
          refused++;
        }
        for (const e of events) {
          if (e.type === 'CapacityReserved') reserved++;
          // Every event must survive the wire: what is stored is what is folded.
          state = hostDecider.evolve(state, parseHostEvent(e.type, JSON.parse(JSON.stringify(e.data))));
        }
        assert.ok(state.status === 'active');
        const a = hostAllocation(state);
        const c = state.capacity;
        assert.ok(
          a.cpus <= c.cpus && a.ram_mb <= c.ram_mb && a.storage_gb <= c.storage_gb && a.vm_count <= c.vm_count,
          `over-committed at step ${i}: ${JSON.stringify(a)}`,
        );
        assert.equal(new Set(a.gpu_device_uuids).size, a.gpu_device_uuids.length, 'a GPU bound twice');
        assert.equal(new Set(a.mig_instance_uuids).size, a.mig_instance_uuids.length, 'a MIG instance bound twice');
        assert.ok(a.gpu_device_uuids.every((u) => ['G1', 'G2', 'G3'].includes(u)));
        assert.ok(a.mig_instance_uuids.every((u) => ['M1', 'M2', 'M3'].includes(u)));
        assert.equal(a.gpus, a.gpu_device_uuids.length);
        assert.equal(a.vm_count, state.reservations.size);
      }
      assert.ok(reserved > 50 && refused > 10, `the run must exercise both outcomes (reserved ${reserved}, refused ${refused})`);
    });
  }
});

describe('host: CPU overcommit', () => {
  const laptop = (over: Partial<RegisterHostData> = {}): HostCommand =>
    registration({ probed_capacity: cap({ cpus: 2, ram_mb: 8192, vm_count: 16 }), ...over });
  const idle = (vm: string): HostCommand => reserve(vm, { cpus: 1, ram_mb: 256, storage_gb: 1 });

  test('the fleet default is recorded at registration; the host override wins over it; 1 records nothing', () => {
    const ratioOf = (c: HostCommand): unknown =>
      (given(hostDecider).when(c).events()[0]?.data as { cpu_overcommit_ratio?: number }).cpu_overcommit_ratio;
    assert.equal(ratioOf(laptop({ default_cpu_overcommit_ratio: 4 })), 4);
    assert.equal(ratioOf(laptop({ default_cpu_overcommit_ratio: 4, overrides: { cpu_overcommit_ratio: 2 } })), 2);
    assert.equal(ratioOf(laptop({ overrides: { cpu_overcommit_ratio: 1.5 } })), 1.5);
    assert.equal(ratioOf(laptop()), undefined);
    given(hostDecider)
      .when(laptop({ overrides: { cpu_overcommit_ratio: 0.5 } }))
      .thenThrows('VALIDATION_FAILED', 400);
  });

  test('given a 2-core host at 4:1 holding 7 idle 1-CPU VMs, an 8th fits and a 9th is refused in vCPUs', () => {
    const seven = ['v1', 'v2', 'v3', 'v4', 'v5', 'v6', 'v7'].map(idle);
    const h = history(laptop({ default_cpu_overcommit_ratio: 4 }), ...seven);
    assert.equal(h.filter((e) => e.type === 'CapacityReserved').length, 7);
    const state = given(hostDecider, h).when(idle('v8')).thenState();
    assert.equal(hostAllocation(state).cpus, 8);
    const err = given(hostDecider, [...h, ...given(hostDecider, h).when(idle('v8')).events()])
      .when(idle('v9'))
      .thenThrows('HOST_CAPACITY_EXHAUSTED', 409, /short of CPUs \(need 1 vCPUs, free 0 of 8: 2 cores × 4 overcommit\)/);
    assert.deepEqual(err.details?.['short'], [{ resource: 'cpus', need: 1, free: 0, overcommit: { ratio: 4, cores: 2, schedulable: 8 } }]);
  });

  test('memory is never overcommitted, whatever the CPU ratio', () => {
    const h = history(laptop({ default_cpu_overcommit_ratio: 8 }), reserve('v1', { cpus: 1, ram_mb: 6144, storage_gb: 1 }));
    given(hostDecider, h)
      .when(reserve('v2', { cpus: 1, ram_mb: 4096, storage_gb: 1 }))
      .thenThrows('HOST_CAPACITY_EXHAUSTED', 409, /short of RAM \(need 4096 MB, free 2048\)/);
  });

  test('a host registered before overcommit existed (no ratio in its event) holds cores, not more', () => {
    const [registered] = history(laptop());
    assert.ok(registered && !('cpu_overcommit_ratio' in registered.data));
    const h = [registered, ...history(laptop(), idle('v1'), idle('v2')).slice(1)];
    given(hostDecider, h)
      .when(idle('v3'))
      .thenThrows('HOST_CAPACITY_EXHAUSTED', 409, /short of CPUs \(need 1, free 0\)/);
  });

  test('registering the same host again with another ratio in force records it (an upgraded embedded default gets 4:1)', () => {
    const old = history(laptop(), idle('v1'), idle('v2'));
    given(hostDecider, old).when(idle('v3')).thenThrows('HOST_CAPACITY_EXHAUSTED', 409);
    given(hostDecider, old)
      .when(laptop({ overrides: { cpu_overcommit_ratio: 4 } }))
      .then([{ type: 'HostCpuOvercommitChanged', data: { host_id: 'h1', cpu_overcommit_ratio: 4, at: NOW } }]);
    const upgraded = history(
      laptop(),
      idle('v1'),
      idle('v2'),
      laptop({ overrides: { cpu_overcommit_ratio: 4 } }),
      ...['v3', 'v4', 'v5', 'v6', 'v7', 'v8'].map(idle),
    );
    assert.equal(hostAllocation(fold(hostDecider, upgraded)).cpus, 8);
    given(hostDecider, upgraded)
      .when(laptop({ overrides: { cpu_overcommit_ratio: 4 } }))
      .then([]);
    // lowered below what is held: the holds stand, nothing more fits until enough are released
    const lowered: HostEvent[] = [
      ...upgraded,
      { type: 'HostCpuOvercommitChanged' as const, data: { host_id: 'h1', cpu_overcommit_ratio: 2, at: NOW } },
    ];
    assert.equal(hostAllocation(fold(hostDecider, lowered)).cpus, 8);
    given(hostDecider, lowered)
      .when(idle('v9'))
      .thenThrows('HOST_CAPACITY_EXHAUSTED', 409, /free 0 of 4: 2 cores × 2 overcommit/);
    for (const e of upgraded) assert.deepEqual(parseHostEvent(e.type, JSON.parse(JSON.stringify(e.data))), e);
  });

  test('random reserve/release at 3:1 never holds more than cores × ratio', () => {
    let state = fold(
      hostDecider,
      history(registration({ probed_capacity: cap({ cpus: 3, ram_mb: 65536, vm_count: 64 }), overrides: { cpu_overcommit_ratio: 3 } })),
    );
    let seed = 7;
    const next = (): number => (seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31;
    let peak = 0;
    for (let i = 0; i < 2000; i++) {
      const vm = `v${Math.floor(next() * 30)}`;
      const command = next() < 0.6 ? reserve(vm, { cpus: 1 + Math.floor(next() * 3), ram_mb: 256, storage_gb: 1 }) : release(vm);
      try {
        for (const e of hostDecider.decide(command, state, { now: at(i) })) state = hostDecider.evolve(state, e);
      } catch (err) {
        assert.equal((err as AppError).code, 'HOST_CAPACITY_EXHAUSTED');
      }
      const cpus = hostAllocation(state).cpus;
      assert.ok(cpus <= 9, `step ${i}: ${cpus} vCPUs held on 3 cores × 3`);
      peak = Math.max(peak, cpus);
    }
    assert.ok(peak >= 8, `the host did fill up (peak ${peak})`);
  });
});
