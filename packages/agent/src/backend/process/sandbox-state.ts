import { z } from 'zod';
import { exposeSchema } from '../spec-rules.js';
import { NO_EGRESS, sandboxEgressSchema } from './egress.js';
import type { Proxy } from './proxy.js';

/** What `<dataDir>/sandboxes/<name>/state.json` holds: all a restarted agent needs to find a sandbox again. */

export const persistedSchema = z.object({
  version: z.literal(1),
  name: z.string(),
  status: z.enum(['creating', 'running', 'paused']),
  tenant: z.string(),
  image: z.string(),
  checkpoint_id: z.string(),
  ip: z.string(),
  mac: z.string(),
  bridge: z.string(),
  veth: z.string(),
  cpus: z.number(),
  ram_mb: z.number(),
  pids_max: z.number(),
  /** Absent in state written before sandboxes had disks: 0, the layer in upper/. */
  storage_gb: z.number().int().nonnegative().default(0),
  created_at: z.string(),
  init_pid: z.number(),
  init_start: z.string(),
  env: z.record(z.string(), z.string()),
  net_raw: z.boolean().default(false),
  /** Host id of the sandbox's root (user namespace); 0: a sandbox from before user namespaces. */
  uid_base: z.number().int().nonnegative().default(0),
  expose: z.array(exposeSchema),
  /** Host port per expose entry (same order), so a restarted agent republishes on the same ports. */
  host_ports: z.array(z.number()),
  /** Absent in state written before egress: none, what those sandboxes had. */
  egress: sandboxEgressSchema.default(NO_EGRESS),
  /** While paused: the memory checkpoint its processes are in (resume restores it). */
  paused_checkpoint: z.string().default(''),
});
export type Persisted = z.output<typeof persistedSchema>;

export interface SandboxRecord {
  state: Persisted;
  proxies: Proxy[];
}
