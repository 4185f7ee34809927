import { z } from 'zod';
import { hostCapacitySchema, type HostCapacity } from '@fleet/agent-protocol';
import { assertNever, compact, type DecideContext, type Decider } from '../decider.js';
import { ValidationError, dottedPath, validationErrorFrom } from '@fleet/agent-protocol';
import { idSchema } from '../ids.js';
import {
  emptyAllocation,
  hasGpuInventory,
  hasMigInventory,
  kindMatches,
  pickGpuDevices,
  pickMigInstances,
  shortfalls,
  wholeGpuDevices,
  type HostAllocation,
} from '../placement/fit.js';
import { applyCapacityOverrides, assertGpuBackend } from './host-capacity.js';
import {
  GpuBindingUnavailableError,
  HostAlreadyRegisteredError,
  HostCapacityExhaustedError,
  HostHasVmsError,
  HostNotFoundError,
  HostUnschedulableError,
} from './host.errors.js';
import {
  capacityOverridesSchema,
  cpuOvercommitRatioSchema,
  hostBackendSchema,
  labelsSchema,
  type CapacityOverrides,
  type HostBackend,
  type HostEvent,
  type Reservation,
} from './host.events.js';

// ---------------------------------------------------------------- commands

export const registerHostDataSchema = z.object({
  host_id: idSchema,
  url: z.url(),
  region: z.string().max(64).default(''),
  backend: hostBackendSchema,
  labels: labelsSchema.default({}),
  probed_capacity: hostCapacitySchema,
  overrides: capacityOverridesSchema.default({}),
  /** The fleet default (CPU_OVERCOMMIT_RATIO); `overrides.cpu_overcommit_ratio` wins over it. */
  default_cpu_overcommit_ratio: cpuOvercommitRatioSchema.default(1),
  token_encrypted: z.string().min(1),
});
export type RegisterHostData = z.input<typeof registerHostDataSchema>;

export const reserveCapacityDataSchema = z.object({
  host_id: idSchema,
  vm_id: idSchema,
  cpus: z.number().int().nonnegative(),
  ram_mb: z.number().int().nonnegative(),
  storage_gb: z.number().int().nonnegative(),
  gpus: z.number().int().nonnegative().default(0),
  gpu_kind: z.string().min(1).optional(),
  gpu_profile: z.string().min(1).optional(),
  /** Device uuids placement chose; omitted: the decider binds the first free ones. */
  gpu_uuids: z.array(z.string().min(1)).optional(),
  mig_instance_uuids: z.array(z.string().min(1)).optional(),
});
export type ReserveCapacityData = z.input<typeof reserveCapacityDataSchema>;

export type HostCommand =
  | { readonly type: 'RegisterHost'; readonly data: RegisterHostData }
  | { readonly type: 'ProbeHostCapacity'; readonly data: { readonly host_id: string; readonly probed_capacity: HostCapacity } }
  | { readonly type: 'CordonHost'; readonly data: { readonly host_id: string; readonly reason?: string | undefined } }
  | { readonly type: 'UncordonHost'; readonly data: { readonly host_id: string } }
  | { readonly type: 'MarkHostUnreachable'; readonly data: { readonly host_id: string; readonly reason: string } }
  | { readonly type: 'MarkHostReachable'; readonly data: { readonly host_id: string } }
  | { readonly type: 'DeregisterHost'; readonly data: { readonly host_id: string; readonly force?: boolean | undefined } }
  | { readonly type: 'ReserveCapacity'; readonly data: ReserveCapacityData }
  | { readonly type: 'ReleaseCapacity'; readonly data: { readonly host_id: string; readonly vm_id: string } }
  /** `previous`: the ciphertext it replaces; a reseal that lost a race to another is a no-op. */
  | {
      readonly type: 'ResealHostToken';
      readonly data: { readonly host_id: string; readonly previous: string; readonly token_encrypted: string };
    };

// ---------------------------------------------------------------- state

export interface RegisteredHost {
  readonly host_id: string;
  readonly url: string;
  readonly region: string;
  readonly backend: HostBackend;
  readonly labels: Readonly<Record<string, string>>;
  /** Effective capacity (probe + overrides). */
  readonly capacity: HostCapacity;
  readonly probed_capacity: HostCapacity;
  readonly overrides: CapacityOverrides;
  /** vCPUs per CPU this host hands out (1: none overcommitted); RAM is never overcommitted. */
  readonly cpu_overcommit_ratio: number;
  readonly token_encrypted: string;
  readonly cordoned: boolean;
  readonly reachable: boolean;
  /** vm_id → its reservation; allocation is derived from these (see `hostAllocation`). */
  readonly reservations: ReadonlyMap<string, Reservation>;
  readonly registered_at: string;
  readonly updated_at: string;
}

/** `unreachable` outranks `cordoned`: both flags are kept, so reachability returning restores a cordon. */
export type HostStatus = 'active' | 'cordoned' | 'unreachable' | 'deregistered';

export type HostState = { readonly status: 'unregistered' } | (RegisteredHost & { readonly status: HostStatus });

export const initialHostState: HostState = { status: 'unregistered' };

function statusOf(h: RegisteredHost, deregistered = false): HostStatus {
  if (deregistered) return 'deregistered';
  if (!h.reachable) return 'unreachable';
  if (h.cordoned) return 'cordoned';
  return 'active';
}

/** What the host's reservations take, summed. The bound uuid sets are derived here, never stored on their own. */
export function hostAllocation(state: HostState): HostAllocation {
  const alloc = emptyAllocation();
  if (state.status === 'unregistered') return alloc;
  for (const r of state.reservations.values()) addReservation(alloc, r);
  return alloc;
}

/** What a reservation takes; also what the command side's placement view holds before its append lands. */
export interface HeldResources {
  readonly cpus: number;
  readonly ram_mb: number;
  readonly storage_gb: number;
  readonly gpus: number;
  readonly gpu_profile?: string | undefined;
  readonly gpu_uuids: readonly string[];
  readonly mig_instance_uuids: readonly string[];
}

export function addReservation(alloc: HostAllocation, r: HeldResources): void {
  alloc.cpus += r.cpus;
  alloc.ram_mb += r.ram_mb;
  alloc.storage_gb += r.storage_gb;
  alloc.vm_count += 1;
  if (r.gpus > 0) {
    if (r.gpu_profile) alloc.mig_profiles[r.gpu_profile] = (alloc.mig_profiles[r.gpu_profile] ?? 0) + r.gpus;
    else alloc.gpus += r.gpus;
  }
  alloc.gpu_device_uuids.push(...r.gpu_uuids);
  alloc.mig_instance_uuids.push(...r.mig_instance_uuids);
}

// ---------------------------------------------------------------- decide

function parseOrThrow<T>(schema: z.ZodType<T>, data: unknown, what: string): T {
  const r = schema.safeParse(data);
  if (r.success) return r.data;
  throw validationErrorFrom(r.error, what, { formatPath: (p) => dottedPath(p) || '(root)' });
}

function registered(state: HostState, hostId: string): RegisteredHost & { readonly status: HostStatus } {
  if (state.status === 'unregistered') throw new HostNotFoundError(hostId);
  return state;
}

function live(state: HostState, hostId: string, doing: string): RegisteredHost & { readonly status: HostStatus } {
  const h = registered(state, hostId);
  if (h.status === 'deregistered') throw new HostUnschedulableError(hostId, 'deregistered', doing);
  return h;
}

export function decideHost(command: HostCommand, state: HostState, ctx: DecideContext): HostEvent[] {
  const at = ctx.now.toISOString();
  switch (command.type) {
    case 'RegisterHost': {
      const d = parseOrThrow(registerHostDataSchema, command.data, 'host registration');
      const ratio = d.overrides.cpu_overcommit_ratio ?? d.default_cpu_overcommit_ratio;
      if (state.status !== 'unregistered' && state.status !== 'deregistered') {
        if (state.url !== d.url || state.backend !== d.backend) throw new HostAlreadyRegisteredError(d.host_id, state.url);
        // The same host again: only a new ratio in force is news (a lower one holds what is reserved, refuses more).
        if (ratio === state.cpu_overcommit_ratio) return [];
        return [{ type: 'HostCpuOvercommitChanged', data: { host_id: d.host_id, cpu_overcommit_ratio: ratio, at } }];
      }
      const capacity = applyCapacityOverrides(d.probed_capacity, d.overrides);
      assertGpuBackend(d.backend, capacity);
      return [
        {
          type: 'HostRegistered',
          data: {
            host_id: d.host_id,
            url: d.url,
            region: d.region,
            backend: d.backend,
            labels: d.labels,
            capacity,
            probed_capacity: d.probed_capacity,
            overrides: d.overrides,
            ...(ratio !== 1 ? { cpu_overcommit_ratio: ratio } : {}),
            token_encrypted: d.token_encrypted,
            at,
          },
        },
      ];
    }

    case 'ProbeHostCapacity': {
      const h = live(state, command.data.host_id, 'record a capacity probe');
      const probed = parseOrThrow(hostCapacitySchema, command.data.probed_capacity, 'capacity probe');
      const capacity = applyCapacityOverrides(probed, h.overrides);
      assertGpuBackend(h.backend, capacity);
      // Periodic probes that change nothing would only grow the stream.
      if (sameJson(capacity, h.capacity) && sameJson(probed, h.probed_capacity)) return [];
      return [{ type: 'HostCapacityProbed', data: { host_id: h.host_id, capacity, probed_capacity: probed, at } }];
    }

    case 'CordonHost': {
      const h = live(state, command.data.host_id, 'cordon');
      if (h.cordoned) return [];
      return [{ type: 'HostCordoned', data: compact({ host_id: h.host_id, reason: command.data.reason, at }) }];
    }

    case 'UncordonHost': {
      const h = live(state, command.data.host_id, 'uncordon');
      if (!h.cordoned) return [];
      return [{ type: 'HostUncordoned', data: { host_id: h.host_id, at } }];
    }

    case 'MarkHostUnreachable': {
      const h = live(state, command.data.host_id, 'mark unreachable');
      if (!h.reachable) return [];
      return [{ type: 'HostMarkedUnreachable', data: { host_id: h.host_id, reason: command.data.reason, at } }];
    }

    case 'MarkHostReachable': {
      const h = live(state, command.data.host_id, 'mark reachable');
      if (h.reachable) return [];
      return [{ type: 'HostReachable', data: { host_id: h.host_id, at } }];
    }

    case 'DeregisterHost': {
      const h = registered(state, command.data.host_id);
      if (h.status === 'deregistered') return [];
      const vmIds = [...h.reservations.keys()].sort();
      if (vmIds.length > 0 && !command.data.force) throw new HostHasVmsError(h.host_id, vmIds);
      return [{ type: 'HostDeregistered', data: { host_id: h.host_id, forced: !!command.data.force, released_vm_ids: vmIds, at } }];
    }

    case 'ReserveCapacity':
      return decideReserve(command.data, state, at);

    case 'ReleaseCapacity': {
      const h = registered(state, command.data.host_id);
      const r = h.reservations.get(command.data.vm_id);
      if (!r) return [];
      return [{ type: 'CapacityReleased', data: { ...r, host_id: h.host_id, at } }];
    }

    case 'ResealHostToken': {
      const h = registered(state, command.data.host_id);
      if (h.token_encrypted !== command.data.previous) return [];
      return [{ type: 'HostTokenResealed', data: { host_id: h.host_id, token_encrypted: command.data.token_encrypted, at } }];
    }

    default:
      return assertNever(command, 'host command');
  }
}

function decideReserve(raw: ReserveCapacityData, state: HostState, at: string): HostEvent[] {
  const req = parseOrThrow(reserveCapacityDataSchema, raw, 'capacity reservation');
  const h = registered(state, req.host_id);
  // A retry of a reservation that already landed: the hold stands, whatever happened to the host since.
  if (h.reservations.has(req.vm_id)) return [];
  if (h.status !== 'active') throw new HostUnschedulableError(h.host_id, h.status, `reserve capacity for vm ${req.vm_id}`);

  const fields = [];
  if (req.gpus === 0 && req.gpu_kind) fields.push({ path: 'gpu_kind', message: 'only with gpus > 0' });
  if (req.gpus === 0 && req.gpu_profile) fields.push({ path: 'gpu_profile', message: 'only with gpus > 0' });
  if (fields.length > 0) throw new ValidationError('invalid capacity reservation: gpu_kind and gpu_profile need gpus > 0', fields);

  const alloc = hostAllocation(h);
  // The invariant, on the host's own stream: reservations never exceed CPUs × ratio, RAM, storage, slots.
  const short = shortfalls(h.capacity, alloc, req, h.cpu_overcommit_ratio);
  if (short.length > 0) throw new HostCapacityExhaustedError(h.host_id, req.vm_id, short, req);

  let gpuUuids: string[] = [];
  let migUuids: string[] = [];
  if (req.gpus > 0 && req.gpu_profile) {
    migUuids = bindMig(h, alloc, req, req.gpu_profile);
  } else if (req.gpus > 0) {
    gpuUuids = bindGpus(h, alloc, req);
  }
  if (req.gpus === 0 && ((req.gpu_uuids?.length ?? 0) > 0 || (req.mig_instance_uuids?.length ?? 0) > 0)) {
    throw new GpuBindingUnavailableError(h.host_id, 'uuids given for a reservation without gpus', [
      ...(req.gpu_uuids ?? []),
      ...(req.mig_instance_uuids ?? []),
    ]);
  }

  const reservation: Reservation = compact({
    vm_id: req.vm_id,
    cpus: req.cpus,
    ram_mb: req.ram_mb,
    storage_gb: req.storage_gb,
    gpus: req.gpus,
    gpu_kind: req.gpu_kind,
    gpu_profile: req.gpu_profile,
    gpu_uuids: gpuUuids,
    mig_instance_uuids: migUuids,
  });
  return [{ type: 'CapacityReserved', data: { ...reservation, host_id: h.host_id, at } }];
}

type ParsedReserve = z.output<typeof reserveCapacityDataSchema>;

function bindGpus(h: RegisteredHost, alloc: HostAllocation, req: ParsedReserve): string[] {
  const given = req.gpu_uuids ?? [];
  if (!hasGpuInventory(h.capacity)) {
    if (given.length > 0)
      throw new GpuBindingUnavailableError(h.host_id, 'it tracks GPUs by count and has no device inventory to bind uuids from', given);
    return [];
  }
  if (given.length === 0) {
    // shortfalls() has already established enough are free.
    return pickGpuDevices(h.capacity, alloc, req.gpu_kind, req.gpus) ?? [];
  }
  const pool = new Set(wholeGpuDevices(h.capacity).map((d) => d.uuid));
  const bad = given.filter((u, i) => !pool.has(u) || alloc.gpu_device_uuids.includes(u) || given.indexOf(u) !== i);
  if (given.length !== req.gpus || bad.length > 0 || !kindMatches(h.capacity.gpu_kind, req.gpu_kind)) {
    throw new GpuBindingUnavailableError(
      h.host_id,
      `cannot bind GPU devices [${given.join(', ')}] for ${req.gpus} × ${req.gpu_kind ?? 'any'}: ${bad.length > 0 ? `unknown, in MIG mode, duplicated or already bound: ${bad.join(', ')}` : 'count or kind does not match'}`,
      given,
    );
  }
  return [...given];
}

function bindMig(h: RegisteredHost, alloc: HostAllocation, req: ParsedReserve, profile: string): string[] {
  const given = req.mig_instance_uuids ?? [];
  if (!hasMigInventory(h.capacity)) {
    if (given.length > 0)
      throw new GpuBindingUnavailableError(h.host_id, 'it tracks MIG instances by profile count and has no instance inventory', given);
    return [];
  }
  if (given.length === 0) return pickMigInstances(h.capacity, alloc, profile, req.gpu_kind, req.gpus) ?? [];
  const ok = new Set(
    h.capacity.mig_instances
      .filter(
        (m) =>
          m.profile === profile && kindMatches(m.kind ?? h.capacity.gpu_kind, req.gpu_kind) && !alloc.mig_instance_uuids.includes(m.uuid),
      )
      .map((m) => m.uuid),
  );
  const bad = given.filter((u, i) => !ok.has(u) || given.indexOf(u) !== i);
  if (given.length !== req.gpus || bad.length > 0) {
    throw new GpuBindingUnavailableError(
      h.host_id,
      `cannot bind MIG instances [${given.join(', ')}] for ${req.gpus} × ${profile}: ${bad.length > 0 ? `unknown, wrong profile or kind, duplicated or already bound: ${bad.join(', ')}` : 'count does not match'}`,
      given,
    );
  }
  return [...given];
}

// ---------------------------------------------------------------- evolve

export function evolveHost(state: HostState, event: HostEvent): HostState {
  switch (event.type) {
    case 'HostRegistered': {
      const d = event.data;
      const body: RegisteredHost = {
        host_id: d.host_id,
        url: d.url,
        region: d.region,
        backend: d.backend,
        labels: d.labels,
        capacity: d.capacity,
        probed_capacity: d.probed_capacity,
        overrides: d.overrides,
        cpu_overcommit_ratio: d.cpu_overcommit_ratio ?? 1,
        token_encrypted: d.token_encrypted,
        cordoned: false,
        reachable: true,
        reservations: new Map(),
        registered_at: d.at,
        updated_at: d.at,
      };
      return { ...body, status: statusOf(body) };
    }
    case 'HostCapacityProbed':
      return update(state, { capacity: event.data.capacity, probed_capacity: event.data.probed_capacity, updated_at: event.data.at });
    case 'HostCordoned':
      return update(state, { cordoned: true, updated_at: event.data.at });
    case 'HostUncordoned':
      return update(state, { cordoned: false, updated_at: event.data.at });
    case 'HostMarkedUnreachable':
      return update(state, { reachable: false, updated_at: event.data.at });
    case 'HostReachable':
      return update(state, { reachable: true, updated_at: event.data.at });
    case 'HostCpuOvercommitChanged':
      return update(state, { cpu_overcommit_ratio: event.data.cpu_overcommit_ratio, updated_at: event.data.at });
    case 'HostDeregistered': {
      if (state.status === 'unregistered') return state;
      return { ...state, reservations: new Map(), updated_at: event.data.at, status: 'deregistered' };
    }
    case 'CapacityReserved': {
      if (state.status === 'unregistered') return state;
      const { host_id: _h, at, ...reservation } = event.data;
      const reservations = new Map(state.reservations);
      reservations.set(reservation.vm_id, reservation);
      return { ...state, reservations, updated_at: at };
    }
    case 'CapacityReleased': {
      if (state.status === 'unregistered') return state;
      const reservations = new Map(state.reservations);
      reservations.delete(event.data.vm_id);
      return { ...state, reservations, updated_at: event.data.at };
    }
    case 'HostTokenResealed':
      return update(state, { token_encrypted: event.data.token_encrypted, updated_at: event.data.at });
    default:
      return assertNever(event, 'host event');
  }
}

function update(state: HostState, patch: Partial<RegisteredHost>): HostState {
  if (state.status === 'unregistered' || state.status === 'deregistered') return state;
  const body: RegisteredHost = { ...state, ...patch };
  return { ...body, status: statusOf(body) };
}

export const hostDecider: Decider<HostCommand, HostEvent, HostState> = {
  decide: decideHost,
  evolve: evolveHost,
  initialState: initialHostState,
};

/** Structural equality over JSON-shaped values, independent of key order. */
function sameJson(a: unknown, b: unknown): boolean {
  if (a === b) return true;
  if (typeof a !== 'object' || typeof b !== 'object' || a === null || b === null) return false;
  if (Array.isArray(a) !== Array.isArray(b)) return false;
  if (Array.isArray(a) && Array.isArray(b)) return a.length === b.length && a.every((v, i) => sameJson(v, b[i]));
  const ka = Object.keys(a).filter((k) => (a as Record<string, unknown>)[k] !== undefined);
  const kb = Object.keys(b).filter((k) => (b as Record<string, unknown>)[k] !== undefined);
  if (ka.length !== kb.length) return false;
  return ka.every((k) => sameJson((a as Record<string, unknown>)[k], (b as Record<string, unknown>)[k]));
}
