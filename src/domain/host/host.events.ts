import { z } from 'zod';
import { hostCapacitySchema } from '@fleet/agent-protocol';
import { parseStoredEvent } from '../stored-event.js';
import { idSchema } from '../ids.js';

export const hostBackendSchema = z.enum(['firecracker', 'qemu', 'process']);
export type HostBackend = z.infer<typeof hostBackendSchema>;

export const labelsSchema = z.record(
  z.string().regex(/^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$/, 'a label key: letters, digits and ._/-, up to 63 characters'),
  z.string().max(253),
);

/**
 * Schedulable vCPUs per physical CPU: 1 never overcommits. Memory is never
 * overcommitted (a sandbox's RAM is a hard cgroup limit, CPU a share of time).
 */
export const cpuOvercommitRatioSchema = z.number().min(1, 'at least 1 (1: no overcommit)').max(64, 'at most 64');

/**
 * Operator overrides applied over the probed capacity at registration, kept
 * in the event so every later re-probe applies them again.
 */
export const capacityOverridesSchema = z
  .object({
    cpus: z.number().int().nonnegative(),
    ram_mb: z.number().int().nonnegative(),
    storage_gb: z.number().int().nonnegative(),
    vm_count: z.number().int().nonnegative(),
    arch: z.string().regex(/^[a-z0-9]+$/),
    gpus: z.number().int().nonnegative(),
    gpu_kind: z.string().min(1),
    mig_profiles: z.record(z.string(), z.number().int().nonnegative()),
    /** This host's CPU overcommit ratio, over the fleet default (CPU_OVERCOMMIT_RATIO). */
    cpu_overcommit_ratio: cpuOvercommitRatioSchema,
  })
  .partial();
export type CapacityOverrides = z.infer<typeof capacityOverridesSchema>;

/** One VM's hold on a host: the durable source of truth for what is allocated (and which GPU/MIG uuids are bound). */
export const reservationSchema = z.object({
  vm_id: idSchema,
  cpus: z.number().int().nonnegative(),
  ram_mb: z.number().int().nonnegative(),
  storage_gb: z.number().int().nonnegative(),
  /** Whole GPUs, or MIG instances when gpu_profile is set. */
  gpus: z.number().int().nonnegative(),
  gpu_kind: z.string().optional(),
  gpu_profile: z.string().optional(),
  /** Bound device uuids, when the host reports gpu_devices; else empty and `gpus` is a count. */
  gpu_uuids: z.array(z.string()),
  /** Bound MIG instance uuids, when the host reports mig_instances; else empty and `gpus` counts by profile. */
  mig_instance_uuids: z.array(z.string()),
});
export type Reservation = z.infer<typeof reservationSchema>;

const at = z.iso.datetime({ offset: true });

export const hostRegisteredSchema = z.object({
  type: z.literal('HostRegistered'),
  data: z.object({
    host_id: idSchema,
    url: z.url(),
    region: z.string(),
    backend: hostBackendSchema,
    labels: labelsSchema,
    /** Effective capacity: probed, with overrides applied. */
    capacity: hostCapacitySchema,
    probed_capacity: hostCapacitySchema,
    overrides: capacityOverridesSchema,
    /** The host's override, else the fleet default when it registered; absent: 1 (no overcommit). */
    cpu_overcommit_ratio: cpuOvercommitRatioSchema.optional(),
    /** AES-256-GCM ciphertext produced by the command layer; the domain never sees the clear token. */
    token_encrypted: z.string().min(1),
    at,
  }),
});

/** The host's token sealed again, unchanged in clear, under the current context (id and URL); written once for a token sealed before the URL was bound. */
export const hostTokenResealedSchema = z.object({
  type: z.literal('HostTokenResealed'),
  data: z.object({ host_id: idSchema, token_encrypted: z.string().min(1), at }),
});

export const hostCapacityProbedSchema = z.object({
  type: z.literal('HostCapacityProbed'),
  data: z.object({ host_id: idSchema, capacity: hostCapacitySchema, probed_capacity: hostCapacitySchema, at }),
});

/** A registration again at the same url and backend, with another CPU overcommit ratio in force (e.g. CPU_OVERCOMMIT_RATIO changed). */
export const hostCpuOvercommitChangedSchema = z.object({
  type: z.literal('HostCpuOvercommitChanged'),
  data: z.object({ host_id: idSchema, cpu_overcommit_ratio: cpuOvercommitRatioSchema, at }),
});

export const hostCordonedSchema = z.object({
  type: z.literal('HostCordoned'),
  data: z.object({ host_id: idSchema, reason: z.string().optional(), at }),
});

export const hostUncordonedSchema = z.object({
  type: z.literal('HostUncordoned'),
  data: z.object({ host_id: idSchema, at }),
});

export const hostMarkedUnreachableSchema = z.object({
  type: z.literal('HostMarkedUnreachable'),
  data: z.object({ host_id: idSchema, reason: z.string(), at }),
});

export const hostReachableSchema = z.object({
  type: z.literal('HostReachable'),
  data: z.object({ host_id: idSchema, at }),
});

export const hostDeregisteredSchema = z.object({
  type: z.literal('HostDeregistered'),
  data: z.object({
    host_id: idSchema,
    forced: z.boolean(),
    /** VMs whose reservations a forced deregistration dropped (empty otherwise). */
    released_vm_ids: z.array(idSchema),
    at,
  }),
});

export const capacityReservedSchema = z.object({
  type: z.literal('CapacityReserved'),
  data: reservationSchema.extend({ host_id: idSchema, at }),
});

export const capacityReleasedSchema = z.object({
  type: z.literal('CapacityReleased'),
  data: reservationSchema.extend({ host_id: idSchema, at }),
});

export const hostEventSchema = z.discriminatedUnion('type', [
  hostRegisteredSchema,
  hostCapacityProbedSchema,
  hostCpuOvercommitChangedSchema,
  hostCordonedSchema,
  hostUncordonedSchema,
  hostMarkedUnreachableSchema,
  hostReachableSchema,
  hostDeregisteredSchema,
  capacityReservedSchema,
  capacityReleasedSchema,
  hostTokenResealedSchema,
]);
export type HostEvent = z.infer<typeof hostEventSchema>;
export type HostEventType = HostEvent['type'];
export const HOST_EVENT_TYPES: readonly HostEventType[] = hostEventSchema.options.map((o) => o.shape.type.value);

export type HostRegistered = z.infer<typeof hostRegisteredSchema>;
export type HostCapacityProbed = z.infer<typeof hostCapacityProbedSchema>;
export type HostCpuOvercommitChanged = z.infer<typeof hostCpuOvercommitChangedSchema>;
export type HostCordoned = z.infer<typeof hostCordonedSchema>;
export type HostUncordoned = z.infer<typeof hostUncordonedSchema>;
export type HostMarkedUnreachable = z.infer<typeof hostMarkedUnreachableSchema>;
export type HostReachable = z.infer<typeof hostReachableSchema>;
export type HostDeregistered = z.infer<typeof hostDeregisteredSchema>;
export type CapacityReserved = z.infer<typeof capacityReservedSchema>;
export type CapacityReleased = z.infer<typeof capacityReleasedSchema>;

/** Parses a stored event (type + data) back into a typed host event; `STORED_EVENT_INVALID` (500) when it does not match. */
export function parseHostEvent(type: string, data: unknown): HostEvent {
  return parseStoredEvent(hostEventSchema, type, data);
}

export function isHostEventType(type: string): type is HostEventType {
  return (HOST_EVENT_TYPES as readonly string[]).includes(type);
}
