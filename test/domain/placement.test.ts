import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import type { HostCapacity } from '@fleet/agent-protocol';
import { AppError } from '@fleet/agent-protocol';
import { emptyAllocation, type HostAllocation } from '../../src/domain/placement/fit.js';
import {
  CapacityExhaustedError,
  place,
  placementDecisionSchema,
  type PlacementHost,
  type PlacementRequest,
} from '../../src/domain/placement/placement.js';

function host(
  id: string,
  over: Partial<Omit<PlacementHost, 'capacity' | 'allocated'>> & {
    capacity?: Partial<HostCapacity>;
    allocated?: Partial<HostAllocation>;
  } = {},
): PlacementHost {
  const { capacity, allocated, ...rest } = over;
  return {
    id,
    state: 'active',
    backend: 'process',
    labels: {},
    revision: 3n,
    ...rest,
    capacity: { cpus: 8, ram_mb: 16384, storage_gb: 100, vm_count: 10, ...capacity },
    allocated: { ...emptyAllocation(), ...allocated },
  };
}

const small: PlacementRequest = { cpus: 1, ram_mb: 1024, storage_gb: 1 };

function refusal(fn: () => unknown): CapacityExhaustedError {
  try {
    fn();
  } catch (e) {
    assert.ok(e instanceof CapacityExhaustedError, String(e));
    assert.equal(e.code, 'CAPACITY_EXHAUSTED');
    assert.equal(e.status, 409);
    return e;
  }
  assert.fail('expected CAPACITY_EXHAUSTED');
}

describe('placement: decision', () => {
  test('returns the host, policy, candidates, headroom after placement, and the revision to reserve at', () => {
    const p = place({ cpus: 2, ram_mb: 4096, storage_gb: 10 }, [host('h1', { allocated: { cpus: 1, ram_mb: 1024 }, revision: 7n })], {
      policy: 'spread',
    });
    assert.deepEqual(p.decision, {
      host_id: 'h1',
      policy: 'spread',
      candidates: 1,
      headroom_cpus: 5,
      headroom_ram: 11264,
      artifact_local: false,
      artifact_holders: 0,
    });
    assert.equal(p.revision, 7n);
    assert.deepEqual(p.gpu_uuids, []);
    assert.deepEqual(p.mig_instance_uuids, []);
    placementDecisionSchema.parse(p.decision);
  });

  test('spread (the default) takes the most headroom by the scarcest normalised resource; binpack the least', () => {
    const hosts = [
      // CPUs 50% free but RAM only 25%: scarcest is RAM.
      host('a', { allocated: { cpus: 4, ram_mb: 12288 } }),
      host('b', { allocated: { cpus: 6, ram_mb: 4096 } }),
      host('c', { allocated: { cpus: 2, ram_mb: 2048 } }),
    ];
    assert.equal(place(small, hosts).decision.host_id, 'c');
    assert.equal(place(small, hosts).decision.policy, 'spread');
    // a's scarcest share after placement is RAM 0.1875, b's is CPUs 0.125: b is the fuller.
    assert.equal(place(small, hosts, { policy: 'binpack' }).decision.host_id, 'b');
  });

  test('headroom is normalised: a big host half full beats a small empty one only when its scarcest share is larger', () => {
    const big = host('big', {
      capacity: { cpus: 64, ram_mb: 262144, storage_gb: 1000, vm_count: 100 },
      allocated: { cpus: 32, ram_mb: 131072, storage_gb: 500, vm_count: 50 },
    });
    const tiny = host('tiny', { capacity: { cpus: 2, ram_mb: 2048, storage_gb: 10, vm_count: 2 } });
    // tiny after placement: cpus 1/2, ram 1024/2048, storage 9/10, vms 1/2 → 0.5; big: ~0.49 → tiny.
    assert.equal(place(small, [big, tiny]).decision.host_id, 'tiny');
    assert.equal(place(small, [big, tiny], { policy: 'binpack' }).decision.host_id, 'big');
  });

  test('ties go to the smallest host id, whatever the input order', () => {
    const hosts = [host('h3'), host('h1'), host('h2')];
    assert.equal(place(small, hosts).decision.host_id, 'h1');
    assert.equal(place(small, [...hosts].reverse()).decision.host_id, 'h1');
    assert.equal(place(small, hosts, { policy: 'binpack' }).decision.host_id, 'h1');
  });
});

describe('placement: gates', () => {
  test('explains per gate why nothing fits: "12 hosts: 3 cordoned, 2 wrong arch, 7 short of RAM (need 4096 MB, best has 2048)"', () => {
    const hosts = [
      ...[1, 2, 3].map((i) => host(`c${i}`, { state: 'cordoned' })),
      host('arm1', { arch: 'arm64' }),
      host('arm2', { capacity: { arch: 'arm64' } }),
      ...[1, 2, 3, 4, 5, 6, 7].map((i) => host(`r${i}`, { allocated: { ram_mb: 16384 - (i === 4 ? 2048 : 1024) } })),
    ];
    const err = refusal(() => place({ cpus: 1, ram_mb: 4096, storage_gb: 1, arch: 'amd64' }, hosts));
    assert.equal(
      err.message,
      'no host fits: 12 hosts: 3 cordoned, 2 wrong arch (need amd64), 7 short of RAM (need 4096 MB, best has 2048)',
    );
    assert.deepEqual(err.refusal, {
      hosts: 12,
      inactive: { cordoned: 3 },
      rejected: { wrong_arch: 2, short_ram: 7 },
      best_free: { ram_mb: 2048 },
    });
    assert.deepEqual(err.details?.['rejected'], { wrong_arch: 2, short_ram: 7 });
  });

  test('every gate in order, each host counted once at the first gate it fails', () => {
    const hosts = [
      host('x', { state: 'active' }),
      host('u', { state: 'unreachable' }),
      host('q', { backend: 'qemu' }),
      host('b1', { region: 'us' }),
      host('b2', { region: 'eu', arch: 'arm64' }),
      host('b3', { region: 'eu', labels: { zone: 'b' } }),
      host('b4', { region: 'eu', labels: { zone: 'a' } }),
      host('b5', { region: 'eu', labels: { zone: 'a', ssd: 'yes' }, allocated: { cpus: 7 } }),
      host('b6', { region: 'eu', labels: { zone: 'a', ssd: 'yes' }, allocated: { storage_gb: 95 } }),
      host('b7', { region: 'eu', labels: { zone: 'a', ssd: 'yes' }, allocated: { vm_count: 10 } }),
    ];
    const req: PlacementRequest = {
      cpus: 2,
      ram_mb: 1024,
      storage_gb: 10,
      backend: 'process',
      region: 'eu',
      arch: 'amd64',
      labels: { zone: 'a', ssd: 'yes' },
    };
    const err = refusal(() => place(req, hosts, { excludeHosts: new Set(['x']) }));
    assert.equal(
      err.message,
      'no host fits: 10 hosts: 1 excluded (already failed this create), 1 unreachable, 1 wrong backend (need process), 1 wrong region (need eu), ' +
        '1 wrong arch (need amd64), 2 without labels zone=a,ssd=yes, 1 short of CPUs (need 2, best has 1), 1 short of storage (need 10 GB, best has 5), ' +
        '1 with no VM slot free (limit reached)',
    );
  });

  test('arch: empty on the host means amd64; empty on the spec means any', () => {
    const legacy = host('legacy');
    const arm = host('arm', { capacity: { arch: 'arm64' } });
    assert.equal(place({ ...small, arch: 'amd64' }, [legacy, arm]).decision.host_id, 'legacy');
    assert.equal(place({ ...small, arch: 'arm64' }, [legacy, arm]).decision.host_id, 'arm');
    assert.equal(place(small, [arm]).decision.host_id, 'arm');
    refusal(() => place({ ...small, arch: 'arm64' }, [legacy]));
  });

  test('labels: every selector pair must match', () => {
    const hosts = [host('a', { labels: { zone: 'a' } }), host('ab', { labels: { zone: 'a', gpu: 'no', extra: 'x' } })];
    assert.equal(place({ ...small, labels: { zone: 'a', gpu: 'no' } }, hosts).decision.host_id, 'ab');
    const err = refusal(() => place({ ...small, labels: { zone: 'c' } }, hosts));
    assert.match(err.message, /2 without labels zone=c/);
  });

  test('a host pin is a gate, not an override: the pinned host must still be active and fit', () => {
    const hosts = [host('h1'), host('h2', { allocated: { cpus: 6 } }), host('h3', { state: 'cordoned' })];
    assert.equal(place({ ...small, host_id: 'h2' }, hosts).decision.host_id, 'h2');
    assert.equal(place({ ...small, host_id: 'h2' }, hosts).decision.candidates, 1);
    assert.match(refusal(() => place({ ...small, host_id: 'h3' }, hosts)).message, /3 hosts: 1 cordoned, 2 not the pinned host h3/);
    assert.match(refusal(() => place({ ...small, cpus: 4, host_id: 'h2' }, hosts)).message, /1 short of CPUs \(need 4, best has 2\)/);
  });

  test('pinned_host_id keeps a host-local seed on its host', () => {
    const hosts = [host('h1'), host('h2', { allocated: { cpus: 6 } })];
    assert.equal(place({ ...small, pinned_host_id: 'h2' }, hosts).decision.host_id, 'h2');
    assert.match(refusal(() => place({ ...small, pinned_host_id: 'h9' }, hosts)).message, /2 not the seed artifact's host h9/);
  });

  test('no hosts at all', () => {
    assert.equal(refusal(() => place(small, [])).message, 'no host fits: 0 hosts registered');
  });
});

describe('placement: GPUs and MIG', () => {
  const inventory = (id: string, bound: string[] = [], over: Partial<HostCapacity> = {}): PlacementHost =>
    host(id, {
      backend: 'qemu',
      capacity: {
        gpus: 3,
        gpu_kind: 'a100',
        gpu_devices: [{ uuid: `${id}-G1` }, { uuid: `${id}-G2` }, { uuid: `${id}-G3` }, { uuid: `${id}-GM`, mig_mode: 'enabled' }],
        mig_instances: [
          { uuid: `${id}-M1`, profile: '1g.10gb', parent_gpu_uuid: `${id}-GM` },
          { uuid: `${id}-M2`, profile: '1g.10gb', parent_gpu_uuid: `${id}-GM` },
          { uuid: `${id}-M3`, profile: '3g.40gb', kind: 'h100' },
        ],
        ...over,
      },
      allocated: {
        gpus: bound.filter((u) => u.includes('-G')).length,
        gpu_device_uuids: bound.filter((u) => u.includes('-G')),
        mig_instance_uuids: bound.filter((u) => u.includes('-M')),
      },
    });

  test('binds free device uuids on an inventory host', () => {
    const p = place({ ...small, gpus: 2, gpu_kind: 'a100' }, [inventory('g1', ['g1-G1'])]);
    assert.deepEqual(p.gpu_uuids, ['g1-G2', 'g1-G3']);
    assert.deepEqual(p.mig_instance_uuids, []);
  });

  test('GPU gate: kind and free count, with the best free in the message', () => {
    const hosts = [inventory('g1', ['g1-G1', 'g1-G2']), inventory('g2', ['g2-G1']), host('cpu')];
    assert.equal(place({ ...small, gpus: 2, gpu_kind: 'a100' }, hosts).decision.host_id, 'g2');
    assert.match(
      refusal(() => place({ ...small, gpus: 3, gpu_kind: 'a100' }, hosts)).message,
      /3 short of a100 GPUs \(need 3, best has 2\)/,
    );
    assert.match(
      refusal(() => place({ ...small, gpus: 1, gpu_kind: 'h100' }, hosts)).message,
      /3 short of h100 GPUs \(need 1, best has 0\)/,
    );
    // No kind asked: any kind.
    assert.equal(place({ ...small, gpus: 1 }, hosts).decision.host_id, 'g2');
  });

  test('count-only hosts: free = gpus − allocated, no uuids', () => {
    const counted = host('c', { backend: 'qemu', capacity: { gpus: 4, gpu_kind: 'a100' }, allocated: { gpus: 3 } });
    const p = place({ ...small, gpus: 1, gpu_kind: 'a100' }, [counted]);
    assert.equal(p.decision.host_id, 'c');
    assert.deepEqual(p.gpu_uuids, []);
    refusal(() => place({ ...small, gpus: 2, gpu_kind: 'a100' }, [counted]));
  });

  test('MIG: free instances of the profile on a kind-matching parent, bound by uuid', () => {
    const hosts = [inventory('m1', ['m1-M1'])];
    const p = place({ ...small, gpus: 1, gpu_kind: 'a100', gpu_profile: '1g.10gb' }, hosts);
    assert.deepEqual(p.mig_instance_uuids, ['m1-M2']);
    assert.deepEqual(p.gpu_uuids, []);
    assert.match(
      refusal(() => place({ ...small, gpus: 2, gpu_kind: 'a100', gpu_profile: '1g.10gb' }, hosts)).message,
      /1 short of MIG 1g.10gb \(a100\) instances \(need 2, best has 1\)/,
    );
    // 3g.40gb exists only on an h100 parent.
    refusal(() => place({ ...small, gpus: 1, gpu_kind: 'a100', gpu_profile: '3g.40gb' }, hosts));
    assert.deepEqual(place({ ...small, gpus: 1, gpu_kind: 'h100', gpu_profile: '3g.40gb' }, hosts).mig_instance_uuids, ['m1-M3']);
  });

  test('MIG by profile count when the host reports no instances', () => {
    const counted = host('c', {
      backend: 'qemu',
      capacity: { gpu_kind: 'a100', mig_profiles: { '1g.10gb': 4 } },
      allocated: { mig_profiles: { '1g.10gb': 3 } },
    });
    const p = place({ ...small, gpus: 1, gpu_kind: 'a100', gpu_profile: '1g.10gb' }, [counted]);
    assert.equal(p.decision.host_id, 'c');
    assert.deepEqual(p.mig_instance_uuids, []);
    assert.match(refusal(() => place({ ...small, gpus: 2, gpu_profile: '1g.10gb' }, [counted])).message, /need 2, best has 1/);
  });
});

describe('placement: artifact locality', () => {
  test('a qualifying holder wins over a roomier non-holder; the decision says it is local', () => {
    const hosts = [host('roomy'), host('holder', { allocated: { cpus: 4, ram_mb: 8192 } })];
    const p = place(small, hosts, { hints: { artifactHosts: new Set(['holder']) } });
    assert.equal(p.decision.host_id, 'holder');
    assert.equal(p.decision.artifact_local, true);
    assert.equal(p.decision.artifact_holders, 1);
    assert.equal(p.decision.candidates, 2);
  });

  test('a holder that fails any gate is never chosen and not counted as a holder', () => {
    const zone = { zone: 'a' };
    const hosts = [
      host('free', { labels: zone, allocated: { cpus: 4 } }),
      host('cordoned-holder', { state: 'cordoned', labels: zone }),
      host('full-holder', { allocated: { ram_mb: 16000 }, labels: zone }),
      host('arm-holder', { arch: 'arm64', labels: zone }),
      host('label-holder', { labels: { zone: 'b' } }),
    ];
    const holders = new Set(['cordoned-holder', 'full-holder', 'arm-holder', 'label-holder', 'unknown-host']);
    for (const policy of ['spread', 'binpack'] as const) {
      const p = place({ ...small, arch: 'amd64', labels: zone }, hosts, { policy, hints: { artifactHosts: holders } });
      assert.equal(p.decision.host_id, 'free');
      assert.equal(p.decision.artifact_local, false);
      assert.equal(p.decision.artifact_holders, 0);
    }
    // Locality never turns a refusal into a placement either.
    refusal(() =>
      place({ ...small, ram_mb: 8192 }, [host('full-holder', { allocated: { ram_mb: 16000 } })], { hints: { artifactHosts: holders } }),
    );
  });

  test('among several qualifying holders, the policy and then the host id decide', () => {
    const hosts = [host('h2'), host('h1'), host('h3', { allocated: { cpus: 4 } }), host('h0')];
    const artifactHosts = new Set(['h1', 'h2', 'h3']);
    assert.equal(place(small, hosts, { hints: { artifactHosts } }).decision.host_id, 'h1');
    assert.equal(place(small, hosts, { policy: 'binpack', hints: { artifactHosts } }).decision.host_id, 'h3');
    assert.equal(place(small, hosts, { hints: { artifactHosts } }).decision.artifact_holders, 3);
  });
});

// Decision time over 10,000 hosts is measured by `npm run bench -- control-plane` (docs/benchmarks.md), not asserted here.
describe('placement: a large fleet', () => {
  test('10,000 hosts: the decision passes every gate and prefers an artifact holder', () => {
    const hosts: PlacementHost[] = [];
    for (let i = 0; i < 10_000; i++) {
      hosts.push(
        host(`h${String(i).padStart(5, '0')}`, {
          state: i % 50 === 0 ? 'cordoned' : 'active',
          arch: i % 7 === 0 ? 'arm64' : undefined,
          labels: { zone: `z${i % 3}`, tier: i % 2 ? 'a' : 'b' },
          allocated: { cpus: i % 8, ram_mb: (i * 512) % 16384, storage_gb: i % 100, vm_count: i % 10 },
        }),
      );
    }
    const artifactHosts = new Set(hosts.filter((_, i) => i % 97 === 0).map((h) => h.id));
    const req: PlacementRequest = { cpus: 2, ram_mb: 2048, storage_gb: 5, arch: 'amd64', labels: { zone: 'z1' } };
    for (const policy of ['spread', 'binpack'] as const) {
      const { decision } = place(req, hosts, { policy, hints: { artifactHosts } });
      const chosen = hosts.find((h) => h.id === decision.host_id)!;
      assert.equal(chosen.state, 'active');
      assert.equal(chosen.labels.zone, 'z1');
      assert.notEqual(chosen.arch, 'arm64');
      assert.ok(chosen.capacity.cpus - chosen.allocated.cpus >= 2 && chosen.capacity.ram_mb - chosen.allocated.ram_mb >= 2048);
      assert.equal(decision.artifact_local, true);
      assert.ok(decision.artifact_holders > 0 && decision.candidates >= decision.artifact_holders);
    }
  });
});

test('placement errors are AppErrors with a stable code', () => {
  const e = refusal(() => place(small, [host('h', { state: 'deregistered' })]));
  assert.ok(e instanceof AppError);
  assert.equal(e.message, 'no host fits: 1 host: 1 deregistered');
});

describe('placement: CPU overcommit', () => {
  test('an overcommitted host is judged in vCPUs (cores × ratio), RAM in plain MB; the decision says so', () => {
    const laptop = host('laptop', {
      cpu_overcommit_ratio: 4,
      capacity: { cpus: 2, ram_mb: 8192 },
      allocated: { cpus: 7, ram_mb: 7 * 256, vm_count: 7 },
    });
    const p = place({ cpus: 1, ram_mb: 256, storage_gb: 1 }, [laptop]);
    assert.equal(p.decision.headroom_cpus, 0);
    assert.deepEqual(p.decision.cpu_overcommit, { ratio: 4, cores: 2, schedulable: 8 });
    placementDecisionSchema.parse(p.decision);
    // RAM is never overcommitted: 8 vCPUs free do not stretch 8192 MB
    const roomy = host('roomy', {
      cpu_overcommit_ratio: 4,
      capacity: { cpus: 2, ram_mb: 1024 },
      allocated: { ram_mb: 1024, vm_count: 1, cpus: 1 },
    });
    assert.match(
      refusal(() => place({ cpus: 1, ram_mb: 256, storage_gb: 1 }, [roomy])).message,
      /1 short of RAM \(need 256 MB, best has 0\)/,
    );
  });

  test('a refusal for CPUs counts in the overcommitted units of the best host', () => {
    const full = host('full', { cpu_overcommit_ratio: 4, capacity: { cpus: 2 }, allocated: { cpus: 7, vm_count: 7 } });
    const plain = host('plain', { capacity: { cpus: 2 }, allocated: { cpus: 2, vm_count: 2 } });
    const err = refusal(() => place({ cpus: 2, ram_mb: 256, storage_gb: 1 }, [plain, full]));
    assert.match(err.message, /2 short of CPUs \(need 2 vCPUs, best has 1 of 8: 2 cores × 4 overcommit\)/);
    assert.deepEqual(err.refusal.cpu_overcommit, { ratio: 4, cores: 2, schedulable: 8 });
    assert.equal(err.refusal.best_free.cpus, 1);
  });

  test('spread weighs CPU headroom in vCPUs: an idle 2-core host at 4:1 beats a half-full 4-core host at 1:1', () => {
    const small4 = host('a', { cpu_overcommit_ratio: 4, capacity: { cpus: 2 } });
    const big1 = host('b', { capacity: { cpus: 4 }, allocated: { cpus: 2, vm_count: 1 } });
    assert.equal(place({ cpus: 1, ram_mb: 256, storage_gb: 1 }, [big1, small4]).decision.host_id, 'a');
  });
});
