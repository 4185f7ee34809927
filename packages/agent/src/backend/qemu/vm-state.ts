import { createHash } from 'node:crypto';
import type { Logger } from 'pino';
import { z } from 'zod';
import { AppError } from '@fleet/agent-protocol';
import type { Proxy } from '../process/proxy.js';
import type { Accel } from './accel.js';
import { ConsoleLog } from './console.js';
import { envKeyRe, exposeSchema, nameRe, tenantRe } from '../spec-rules.js';

/** What a VM is: the backend's options, the create spec, state.json and the in-memory record. */

export interface QemuBackendOptions {
  readonly dataDir: string;
  readonly imageDir: string;
  readonly subnet: string;
  readonly bridgePrefix: string;
  readonly maxSandboxes: number;
  readonly allowCrossTenant: boolean;
  readonly publishHost: string;
  readonly advertiseHost?: string;
  readonly defaultImage: string;
  /** auto: probe KVM and fall back to TCG. */
  readonly accel?: 'auto' | Accel;
  /** Bound on boot until the in-guest agent answers. */
  readonly bootTimeoutMs?: number;
  /** Bound on the KVM probe. */
  readonly kvmProbeTimeoutMs?: number;
  readonly qemuBinary?: string;
  /** serial.log is cut to its newer half past this. */
  readonly consoleLogMaxBytes?: number;
  readonly logger?: Logger;
  /** Where the GPU probe reads sysfs and the VFIO group nodes (default /sys and /dev; fixtures in tests). */
  readonly sysfsRoot?: string;
  readonly devRoot?: string;
}

const networkSchema = z.object({ id: z.string().regex(/^[a-z0-9][a-z0-9-]{0,62}$/), subnet: z.string() });

export const createSpecSchema = z.object({
  name: z.string().regex(nameRe, 'a sandbox name is 1-63 of [a-z0-9-], starting with a letter or digit'),
  image: z.string().min(1).optional(),
  checkpointId: z.string().min(1).optional(),
  resume: z.boolean().optional(),
  cpus: z.number().positive().max(255),
  ram_mb: z
    .number()
    .int()
    .min(128, 'a VM needs at least 128 MiB')
    .max(1024 * 1024),
  pids_max: z.number().int().optional(),
  storage_gb: z.number().int().min(0).max(65536).optional(),
  tenant: z.string().regex(tenantRe, 'a tenant id is 1-63 of [a-z0-9_-], starting with a letter or digit'),
  ipHint: z.string().optional(),
  expose: z.array(exposeSchema).max(64).optional(),
  env: z
    .record(
      z.string().regex(envKeyRe, 'an environment variable name'),
      z.string().refine((v) => !v.includes('\0')),
    )
    .optional(),
  net_raw: z.boolean().optional(),
  /** A cluster network: its members share a bridge of their own, their addresses inside its subnet (process/sandbox-cluster.ts). */
  network: networkSchema.optional(),
  /** Bound by the control plane: uuids from this host's capacity (gpu-probe.ts maps them to devices). */
  gpuUuids: z.array(z.string().min(1)).max(16).optional(),
  migInstanceUuids: z.array(z.string().min(1)).max(16).optional(),
});

export const stateSchema = z.object({
  name: z.string(),
  status: z.enum(['creating', 'running', 'paused']),
  /** While paused: the live checkpoint its state is in (resume loads it). */
  paused_checkpoint: z.string().default(''),
  /** The checkpoint it was last restored from. */
  checkpoint_id: z.string().default(''),
  /** vmgenid guid: a new one on every restore of a copy (a fork, an earlier state), so the guest reseeds its RNG. */
  vmgenid: z.string().default(''),
  tenant: z.string(),
  image: z.string(),
  ip: z.string(),
  mac: z.string(),
  cpus: z.number(),
  ram_mb: z.number(),
  storage_gb: z.number(),
  disk_bytes: z.number(),
  created_at: z.string(),
  bridge: z.string(),
  tap: z.string(),
  token: z.string(),
  accel: z.enum(['kvm', 'tcg']),
  env: z.record(z.string(), z.string()),
  expose: z.array(exposeSchema),
  endpoints: z.array(z.object({ as: z.string(), port: z.number(), protocol: z.enum(['tcp', 'udp']), host_port: z.number() })),
  pid: z.number(),
  pid_start: z.string(),
  network: networkSchema.optional(),
  /** Devices passed through (gpu-probe.ts GpuBinding): every launch of this VM gets them. */
  gpu: z.object({ uuids: z.array(z.string()), pci_addresses: z.array(z.string()), mdev_uuids: z.array(z.string()) }).optional(),
  /** Came by post-copy and its QEMU has not yet said the stream completed: the memory status asks QEMU, across agent restarts. */
  postcopy_incoming: z.boolean().optional(),
});
export type VmState = z.infer<typeof stateSchema>;

export interface VmRecord {
  state: VmState;
  proxies: Proxy[];
  console?: ConsoleLog | undefined;
  /** Waiting for a live migration's stream (prepareIncoming until completeIncoming). */
  incoming?: { pskDir: string; timer: NodeJS.Timeout } | undefined;
  /** A post-copy source still sending pages: the target's guest needs this QEMU until it settles. */
  draining?: Promise<void> | undefined;
}

export const nameHash = (name: string): string => createHash('sha256').update(name).digest('hex').slice(0, 12);

export const unsupportedByQemu = (what: string): AppError =>
  new AppError('BACKEND_UNSUPPORTED', 409, `the qemu backend does not support ${what} yet (docs/qemu-backend.md)`, { backend: 'qemu' });
