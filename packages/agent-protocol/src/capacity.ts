import { z } from 'zod';

/**
 * Host capacity, shared by the host-agent protocol (`GET /v1/capacity`) and
 * the host aggregate. Field names follow the seed's JSON tags (snake_case on
 * the wire).
 */

/** GOARCH vocabulary. Empty/absent means amd64: every host that predates the field was x86_64. */
export const archSchema = z.string().regex(/^[a-z0-9]+$/, 'an architecture in GOARCH vocabulary, e.g. amd64 or arm64');

export function normalizeArch(arch: string | undefined | null): string {
  return arch && arch.length > 0 ? arch : 'amd64';
}

export const gpuDeviceSchema = z.object({
  uuid: z.string().min(1),
  model: z.string().optional(),
  pci_bus_id: z.string().optional(),
  memory_mb: z.number().int().nonnegative().optional(),
  driver_version: z.string().optional(),
  cuda_version: z.string().optional(),
  compute_cap: z.string().optional(),
  mig_capable: z.boolean().optional(),
  mig_mode: z.string().optional(),
  iommu_group: z.string().optional(),
});
export type GpuDevice = z.infer<typeof gpuDeviceSchema>;

export const migInstanceSchema = z.object({
  uuid: z.string().min(1),
  profile: z.string().min(1),
  kind: z.string().optional(),
  parent_gpu_uuid: z.string().optional(),
});
export type MigInstance = z.infer<typeof migInstanceSchema>;

export const hostCapacitySchema = z.object({
  cpus: z.number().int().nonnegative(),
  ram_mb: z.number().int().nonnegative(),
  storage_gb: z.number().int().nonnegative(),
  /** Max concurrent VMs. */
  vm_count: z.number().int().nonnegative(),
  arch: z.string().optional(),
  /** Whole GPU devices. Independent of MIG capacity (a GPU in MIG mode is never in this pool). */
  gpus: z.number().int().nonnegative().optional(),
  gpu_kind: z.string().optional(),
  /** MIG instance count by profile, e.g. {"1g.10gb": 4}. A derived summary when mig_instances is reported. */
  mig_profiles: z.record(z.string(), z.number().int().nonnegative()).optional(),
  /** Per-instance MIG inventory: when non-empty, allocation binds instance uuids instead of counting. */
  mig_instances: z.array(migInstanceSchema).optional(),
  /** Per-device inventory: when non-empty, allocation binds device uuids instead of counting. */
  gpu_devices: z.array(gpuDeviceSchema).optional(),
  /** Memory checkpoints (CRIU): live snapshots, pause and resume, fork and live moves of running sandboxes. */
  live_snapshot: z.boolean().optional(),
  /** Post-copy (lazy) restores. */
  lazy_pages: z.boolean().optional(),
  /** Memory dirty tracking, which diff snapshots need. */
  memory_diff: z.boolean().optional(),
});
export type HostCapacity = z.infer<typeof hostCapacitySchema>;
