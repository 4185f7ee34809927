import { z } from 'zod';
import { normalizeArch, type HostCapacity } from '@fleet/agent-protocol';
import { ConflictError } from '@fleet/agent-protocol';
import type { HostBackend } from '../host/host.events.js';
import {
  describeShortfall,
  freeGpuCount,
  freeMigCount,
  pickGpuDevices,
  pickMigInstances,
  schedulableCpus,
  type CpuOvercommit,
  type HostAllocation,
  type ResourceRequest,
  type ShortResource,
} from './fit.js';

export const placementPolicySchema = z.enum(['spread', 'binpack']);
export type PlacementPolicy = z.infer<typeof placementPolicySchema>;

export const placementDecisionSchema = z.object({
  host_id: z.string(),
  policy: placementPolicySchema,
  /** Hosts that passed every gate. */
  candidates: z.number().int().nonnegative(),
  /** CPUs left on the winner after this placement: vCPUs (cores × ratio) when it overcommits. */
  headroom_cpus: z.number().int(),
  /** Present when the winner overcommits CPU: its ratio, physical cores, and the vCPUs it hands out. */
  cpu_overcommit: z.object({ ratio: z.number(), cores: z.number().int(), schedulable: z.number().int() }).optional(),
  /** RAM (MB) left on the winner after this placement. */
  headroom_ram: z.number().int(),
  /** The winner already holds the seed artifact: no transfer before boot. */
  artifact_local: z.boolean(),
  /** How many candidates held the artifact. Positive with artifact_local false cannot happen. */
  artifact_holders: z.number().int().nonnegative(),
});
export type PlacementDecision = z.infer<typeof placementDecisionSchema>;

/** One row of the placement view (the `hosts` read model). */
export interface PlacementHost {
  readonly id: string;
  /** Only `active` is schedulable; any other state is counted by its name in the refusal. */
  readonly state: string;
  readonly backend: HostBackend;
  readonly region?: string | undefined;
  /** Falls back to capacity.arch; empty means amd64. */
  readonly arch?: string | undefined;
  readonly labels: Readonly<Record<string, string>>;
  readonly capacity: HostCapacity;
  /** vCPUs per CPU (host stream's HostRegistered); absent: 1. */
  readonly cpu_overcommit_ratio?: number | undefined;
  readonly allocated: HostAllocation;
  /** The host stream's revision this row reflects: the reservation is appended expecting it. */
  readonly revision: bigint;
}

/** The placement-relevant part of a VM spec. */
export interface PlacementRequest extends ResourceRequest {
  /** Empty: any arch. */
  readonly arch?: string | undefined;
  readonly backend?: HostBackend | undefined;
  /** Empty: any region. */
  readonly region?: string | undefined;
  /** Every pair must equal the host's label. */
  readonly labels?: Readonly<Record<string, string>> | undefined;
  /** Caller's hard pin (seed `HostID`): a gate, not an override. */
  readonly host_id?: string | undefined;
  /** Where a host-local seed artifact is (seed `PinnedHostID`). */
  readonly pinned_host_id?: string | undefined;
  /** The host a cluster network's live members run on: a network spans one host (docs/networking.md). */
  readonly network_host_id?: string | undefined;
}

export interface PlacementOptions {
  readonly policy?: PlacementPolicy | undefined;
  readonly hints?: { readonly artifactHosts?: ReadonlySet<string> | undefined } | undefined;
  /** Hosts that already failed this create (not for capacity): never chosen again for it. */
  readonly excludeHosts?: ReadonlySet<string> | undefined;
}

export interface Placement {
  readonly decision: PlacementDecision;
  /** Expected revision of `host-<id>` for the reservation. */
  readonly revision: bigint;
  /** Device uuids to bind (hosts with gpu_devices inventory), else empty. */
  readonly gpu_uuids: string[];
  /** MIG instance uuids to bind (hosts with mig_instances inventory), else empty. */
  readonly mig_instance_uuids: string[];
}

/** Gate keys, in the order hosts are judged; a host is counted under the first gate it fails. */
export type PlacementGate =
  | 'excluded'
  | 'wrong_backend'
  | 'wrong_region'
  | 'wrong_arch'
  | 'labels_mismatch'
  | 'not_pinned_host'
  | 'not_seed_host'
  | 'not_network_host'
  | 'short_cpus'
  | 'short_ram'
  | 'short_storage'
  | 'no_vm_slot'
  | 'short_gpus'
  | 'short_mig';

export interface PlacementRefusal {
  readonly hosts: number;
  /** Non-active hosts by state name (e.g. cordoned, unreachable). */
  readonly inactive: Readonly<Record<string, number>>;
  readonly rejected: Readonly<Partial<Record<PlacementGate, number>>>;
  /** For each resource gate, the most any host rejected there had free. */
  readonly best_free: Readonly<Partial<Record<ShortResource, number>>>;
  /** When the host with the most free CPUs among those short of them overcommits: best_free.cpus is in its vCPUs. */
  readonly cpu_overcommit?: CpuOvercommit | undefined;
}

export class CapacityExhaustedError extends ConflictError {
  readonly refusal: PlacementRefusal;
  constructor(message: string, refusal: PlacementRefusal) {
    super('CAPACITY_EXHAUSTED', message, { ...refusal });
    this.refusal = refusal;
  }
}

const SCORE_SCALE = 1e6;

/**
 * Headroom of a host after placing `req`: the scarcest resource's remaining
 * fraction, min over CPUs, RAM, storage and VM slots (and the requested GPU
 * pool), each (free − need) / capacity, rounded to 1e-6 so equal hosts tie
 * exactly. `spread` takes the most, `binpack` the least.
 */
function headroomScore(
  cap: HostCapacity,
  cpus: number,
  alloc: HostAllocation,
  req: ResourceRequest,
  gpuFree: number,
  gpuTotal: number,
): number {
  let min = Infinity;
  if (cpus > 0) min = Math.min(min, (cpus - alloc.cpus - req.cpus) / cpus);
  if (cap.ram_mb > 0) min = Math.min(min, (cap.ram_mb - alloc.ram_mb - req.ram_mb) / cap.ram_mb);
  if (cap.storage_gb > 0) min = Math.min(min, (cap.storage_gb - alloc.storage_gb - req.storage_gb) / cap.storage_gb);
  if (cap.vm_count > 0) min = Math.min(min, (cap.vm_count - alloc.vm_count - 1) / cap.vm_count);
  if (gpuTotal > 0) min = Math.min(min, (gpuFree - (req.gpus ?? 0)) / gpuTotal);
  return min === Infinity ? 0 : Math.round(min * SCORE_SCALE);
}

/**
 * Chooses a host in one pass over the view, without sorting: the gates in
 * order (exclusion, active state, backend, region, arch, labels, host pin,
 * seed pin, CPUs, RAM, storage, VM slots, GPUs or MIG instances), then among
 * the hosts that pass every gate: artifact holders first, then the policy's
 * headroom, then the smallest host id.
 *
 * Locality ranks above headroom only among hosts that already qualify (seed
 * PlacementHints: a holder failing any gate is rejected before locality is
 * consulted; PlacementDecision: holders > 0 with artifact_local false cannot
 * happen), so it can never turn a fitting create into a failing one.
 *
 * Throws CapacityExhaustedError (CAPACITY_EXHAUSTED, 409) saying per gate why
 * nothing fits.
 */
export function place(req: PlacementRequest, hosts: readonly PlacementHost[], opts: PlacementOptions = {}): Placement {
  const policy: PlacementPolicy = opts.policy ?? 'spread';
  const artifactHosts = opts.hints?.artifactHosts;
  const exclude = opts.excludeHosts;
  const wantArch = req.arch ? normalizeArch(req.arch) : undefined;
  const labelKeys = req.labels ? Object.keys(req.labels) : [];
  const labels = req.labels ?? {};
  const gpus = req.gpus ?? 0;
  const profile = gpus > 0 ? req.gpu_profile : undefined;
  const spread = policy === 'spread';

  const inactive: Record<string, number> = {};
  const rejected: Partial<Record<PlacementGate, number>> = {};
  const bestFree: Partial<Record<ShortResource, number>> = {};
  const reject = (gate: PlacementGate): void => {
    rejected[gate] = (rejected[gate] ?? 0) + 1;
  };
  const short = (gate: PlacementGate, resource: ShortResource, free: number): void => {
    rejected[gate] = (rejected[gate] ?? 0) + 1;
    const f = Math.max(0, free);
    if (bestFree[resource] === undefined || f > bestFree[resource]) bestFree[resource] = f;
  };

  let cpuOvercommitAtBest: CpuOvercommit | undefined;
  let best: PlacementHost | undefined;
  let bestScore = 0;
  let bestLocal = false;
  let candidates = 0;
  let holders = 0;

  for (const h of hosts) {
    if (exclude !== undefined && exclude.has(h.id)) {
      reject('excluded');
      continue;
    }
    if (h.state !== 'active') {
      inactive[h.state] = (inactive[h.state] ?? 0) + 1;
      continue;
    }
    if (req.backend && h.backend !== req.backend) {
      reject('wrong_backend');
      continue;
    }
    if (req.region && h.region !== req.region) {
      reject('wrong_region');
      continue;
    }
    if (wantArch !== undefined && normalizeArch(h.arch || h.capacity.arch) !== wantArch) {
      reject('wrong_arch');
      continue;
    }
    let labelsOk = true;
    for (const k of labelKeys) {
      if (h.labels[k] !== labels[k]) {
        labelsOk = false;
        break;
      }
    }
    if (!labelsOk) {
      reject('labels_mismatch');
      continue;
    }
    if (req.host_id && h.id !== req.host_id) {
      reject('not_pinned_host');
      continue;
    }
    if (req.pinned_host_id && h.id !== req.pinned_host_id) {
      reject('not_seed_host');
      continue;
    }
    if (req.network_host_id && h.id !== req.network_host_id) {
      reject('not_network_host');
      continue;
    }
    const cap = h.capacity;
    const alloc = h.allocated;
    const ratio = h.cpu_overcommit_ratio ?? 1;
    const cpus = schedulableCpus(cap, ratio);
    const freeCpus = cpus - alloc.cpus;
    if (freeCpus < req.cpus) {
      const before = bestFree.cpus;
      short('short_cpus', 'cpus', freeCpus);
      if (bestFree.cpus !== before) cpuOvercommitAtBest = ratio !== 1 ? { ratio, cores: cap.cpus, schedulable: cpus } : undefined;
      continue;
    }
    const freeRam = cap.ram_mb - alloc.ram_mb;
    if (freeRam < req.ram_mb) {
      short('short_ram', 'ram_mb', freeRam);
      continue;
    }
    const freeStorage = cap.storage_gb - alloc.storage_gb;
    if (freeStorage < req.storage_gb) {
      short('short_storage', 'storage_gb', freeStorage);
      continue;
    }
    if (cap.vm_count - alloc.vm_count < 1) {
      short('no_vm_slot', 'vm_count', cap.vm_count - alloc.vm_count);
      continue;
    }
    let gpuFree = 0;
    let gpuTotal = 0;
    if (gpus > 0) {
      if (profile) {
        gpuFree = freeMigCount(cap, alloc, profile, req.gpu_kind);
        if (gpuFree < gpus) {
          short('short_mig', 'mig_instances', gpuFree);
          continue;
        }
        gpuTotal = cap.mig_instances && cap.mig_instances.length > 0 ? cap.mig_instances.length : (cap.mig_profiles?.[profile] ?? 0);
      } else {
        gpuFree = freeGpuCount(cap, alloc, req.gpu_kind);
        if (gpuFree < gpus) {
          short('short_gpus', 'gpus', gpuFree);
          continue;
        }
        gpuTotal = Math.max(cap.gpus ?? 0, gpuFree);
      }
    }

    candidates++;
    const local = artifactHosts !== undefined && artifactHosts.has(h.id);
    if (local) holders++;
    const score = headroomScore(cap, cpus, alloc, req, gpuFree, gpuTotal);
    if (best === undefined || better(local, score, h.id, bestLocal, bestScore, best.id, spread)) {
      best = h;
      bestScore = score;
      bestLocal = local;
    }
  }

  if (best === undefined) {
    const refusal: PlacementRefusal = {
      hosts: hosts.length,
      inactive,
      rejected,
      best_free: bestFree,
      ...(cpuOvercommitAtBest ? { cpu_overcommit: cpuOvercommitAtBest } : {}),
    };
    throw new CapacityExhaustedError(refusalMessage(req, refusal), refusal);
  }

  const cap = best.capacity;
  const alloc = best.allocated;
  const ratio = best.cpu_overcommit_ratio ?? 1;
  const cpus = schedulableCpus(cap, ratio);
  let gpuUuids: string[] = [];
  let migUuids: string[] = [];
  if (gpus > 0 && profile) migUuids = pickMigInstances(cap, alloc, profile, req.gpu_kind, gpus) ?? [];
  else if (gpus > 0) gpuUuids = pickGpuDevices(cap, alloc, req.gpu_kind, gpus) ?? [];

  return {
    decision: {
      host_id: best.id,
      policy,
      candidates,
      headroom_cpus: cpus - alloc.cpus - req.cpus,
      ...(ratio !== 1 ? { cpu_overcommit: { ratio, cores: cap.cpus, schedulable: cpus } } : {}),
      headroom_ram: cap.ram_mb - alloc.ram_mb - req.ram_mb,
      artifact_local: bestLocal,
      artifact_holders: holders,
    },
    revision: best.revision,
    gpu_uuids: gpuUuids,
    mig_instance_uuids: migUuids,
  };
}

function better(local: boolean, score: number, id: string, bLocal: boolean, bScore: number, bId: string, spread: boolean): boolean {
  if (local !== bLocal) return local;
  if (score !== bScore) return spread ? score > bScore : score < bScore;
  return id < bId;
}

const RESOURCE_GATES: ReadonlyArray<readonly [PlacementGate, ShortResource]> = [
  ['short_cpus', 'cpus'],
  ['short_ram', 'ram_mb'],
  ['short_storage', 'storage_gb'],
  ['no_vm_slot', 'vm_count'],
  ['short_gpus', 'gpus'],
  ['short_mig', 'mig_instances'],
];

/** "12 hosts: 3 cordoned, 2 wrong arch (need arm64), 7 short of RAM (need 4096 MB, best has 2048)". */
export function refusalMessage(req: PlacementRequest, r: PlacementRefusal): string {
  if (r.hosts === 0) return 'no host fits: 0 hosts registered';
  const parts: string[] = [];
  const n = (gate: PlacementGate): number => r.rejected[gate] ?? 0;
  if (n('excluded')) parts.push(`${n('excluded')} excluded (already failed this create)`);
  for (const [state, count] of Object.entries(r.inactive).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0))) parts.push(`${count} ${state}`);
  if (n('wrong_backend')) parts.push(`${n('wrong_backend')} wrong backend (need ${req.backend})`);
  if (n('wrong_region')) parts.push(`${n('wrong_region')} wrong region (need ${req.region})`);
  if (n('wrong_arch')) parts.push(`${n('wrong_arch')} wrong arch (need ${normalizeArch(req.arch)})`);
  if (n('labels_mismatch')) {
    const want = Object.entries(req.labels ?? {})
      .map(([k, v]) => `${k}=${v}`)
      .join(',');
    parts.push(`${n('labels_mismatch')} without labels ${want}`);
  }
  if (n('not_pinned_host')) parts.push(`${n('not_pinned_host')} not the pinned host ${req.host_id}`);
  if (n('not_seed_host')) parts.push(`${n('not_seed_host')} not the seed artifact's host ${req.pinned_host_id}`);
  if (n('not_network_host')) parts.push(`${n('not_network_host')} not the network's host ${req.network_host_id}`);
  for (const [gate, resource] of RESOURCE_GATES) {
    if (!n(gate)) continue;
    const free = r.best_free[resource] ?? 0;
    const need = resource === 'vm_count' ? 1 : resource === 'gpus' || resource === 'mig_instances' ? (req.gpus ?? 0) : req[resource];
    const overcommit = resource === 'cpus' ? r.cpu_overcommit : undefined;
    parts.push(`${n(gate)} ${describeShortfall({ resource, need, free, overcommit }, req, 'best has')}`);
  }
  return `no host fits: ${r.hosts} host${r.hosts === 1 ? '' : 's'}: ${parts.join(', ')}`;
}
