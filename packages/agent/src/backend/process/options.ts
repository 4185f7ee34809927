import { existsSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
import type { Logger } from 'pino';
import { z } from 'zod';
import { featureMissing } from '../../backend.js';
import { runTool } from './exec-util.js';
import { USERNS_SIZE } from './launch.js';
import { monitorOptionsSchema } from './monitor-options.js';

export const optionsSchema = z.object({
  dataDir: z.string().min(1),
  imageDir: z.string().min(1),
  subnet: z.string().default('10.213.0.0/16'),
  bridgePrefix: z
    .string()
    .regex(/^[a-z][a-z0-9]{0,4}$/, 'bridgePrefix must be 1-5 of [a-z0-9], starting with a letter')
    .default('fb'),
  maxSandboxes: z.number().int().positive().default(64),
  allowCrossTenant: z.boolean().default(false),
  publishHost: z.string().default('127.0.0.1'),
  /** Host written into endpoint URLs; default publishHost (127.0.0.1 when publishing on 0.0.0.0). */
  advertiseHost: z.string().optional(),
  defaultImage: z.string().default('base'),
  defaultPidsMax: z.number().int().positive().default(1024),
  busybox: z.string().default('/bin/busybox'),
  cgroupRoot: z.string().default('/sys/fs/cgroup'),
  /** TTY implementation: node-pty when installed, else script(1); 'script' forces the fallback. */
  pty: z.enum(['auto', 'script']).default('auto'),
  /**
   * Host ids for sandbox user namespaces: each sandbox gets its own block of
   * 65536 ids, picked at random among the free blocks in [uidBase, 2^32).
   */
  uidBase: z
    .number()
    .int()
    .min(USERNS_SIZE)
    .max(2 ** 31)
    .multipleOf(USERNS_SIZE)
    .default(2 ** 28),
  /** The console log lives on the data dir's filesystem, outside the sandbox's disk: at most this many bytes of it are kept. */
  consoleLogMaxBytes: z
    .number()
    .int()
    .min(4096)
    .default(16 * 1024 * 1024),
  ...monitorOptionsSchema.shape,
  /** Port of the agent's egress proxy on the gateway address (proxy-mode sandboxes). */
  egressProxyPort: z.number().int().min(1).max(65535).default(3128),
  /** Private CIDRs direct-mode sandboxes may reach without an allow_out of their own. */
  egressAllowPrivate: z.array(z.string()).default([]),
  /** DNS servers the egress proxy resolves names with; empty: the host's resolver. */
  egressDnsServers: z.array(z.string()).default([]),
  /** Sandbox disks kept formatted ahead of creates (disk-pool.ts); 0: none (the library default; the agent's is AGENT_DISK_POOL). */
  diskPool: z.number().int().min(0).max(64).default(0),
  /** storage_gb of the pooled disks: creates asking for another size format their own. */
  diskPoolGb: z.number().int().min(1).max(64).default(1),
  /**
   * A restore from this host's own checkpoint files (resume, fork, move, restore in place) runs first and pages its
   * memory in afterwards from those files (criu lazy-pages), when the host can (CriuFeatures.lazyPages); a memory
   * capture of the sandbox waits until every page is in. false: every page is read before it runs.
   */
  lazyRestore: z.boolean().default(true),
});
export type ProcessBackendOptions = z.input<typeof optionsSchema> & { logger?: Logger };
export type ProcessOptions = z.output<typeof optionsSchema>;

/** Linux, root, overlayfs and the namespaces a sandbox is made of. */
export async function assertHostFeatures(): Promise<void> {
  if (process.platform !== 'linux') throw featureMissing('Linux', 'the process backend runs sandboxes with Linux namespaces');
  if (typeof process.getuid === 'function' && process.getuid() !== 0)
    throw featureMissing('root', 'the process backend must run as root (namespaces, mounts, cgroups, bridges)');
  const fss = await readFile('/proc/filesystems', 'utf8').catch(() => '');
  if (!/\toverlay$/m.test(fss)) {
    // The module may simply not be loaded yet.
    await runTool('modprobe', ['overlay']).catch(() => undefined);
    const again = await readFile('/proc/filesystems', 'utf8').catch(() => '');
    if (!/\toverlay$/m.test(again)) throw featureMissing('overlayfs', 'load the overlay kernel module (modprobe overlay)');
  }
  for (const ns of ['user', 'pid', 'mnt', 'uts', 'ipc', 'net']) {
    if (!existsSync(`/proc/self/ns/${ns}`)) throw featureMissing(`${ns} namespaces`, 'use a kernel built with namespaces');
  }
}
