import { existsSync } from 'node:fs';
import { mkdir, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { z } from 'zod';
import { AppError, describeFields, dottedPath, fieldsFromZod } from '@fleet/agent-protocol';
import { capacityExhausted, invalidSpec, sandboxExists, sandboxFailed, type CreateSpec, type SandboxInfo } from '../../backend.js';
import { resolveImage } from '../../images.js';
import { envKeyRe, exposeSchema, nameRe, tenantRe } from '../spec-rules.js';
import { restoreInto } from './criu-sandbox.js';
import { usesAgentProxy } from './egress-host.js';
import { NO_EGRESS, sandboxEgressSchema } from './egress.js';
import { allocateBridge, allocateVeth } from './network.js';
import { bridgeKeyOf, reserveAddress } from './sandbox-cluster.js';
import type { SandboxHost } from './sandbox-host.js';
import type { Persisted, SandboxRecord } from './sandbox-state.js';
import { teardownSandbox } from './sandbox-teardown.js';
import { createDisk, DISK_IMAGE, layerDirs, removeDisk } from './storage.js';

const createSpecSchema = z.object({
  name: z.string().regex(nameRe, 'a sandbox name is 1-63 of [a-z0-9-], starting with a letter or digit'),
  image: z.string().min(1).optional(),
  checkpointId: z.string().min(1).optional(),
  cpus: z.number().positive().max(1024),
  ram_mb: z
    .number()
    .int()
    .min(16, 'at least 16 MiB')
    .max(16 * 1024 * 1024),
  pids_max: z.number().int().min(8).max(4_194_304).optional(),
  /** GiB of the sandbox's own disk (its writable layer); 0: no disk of its own. */
  storage_gb: z.number().int().min(0).max(65536).optional(),
  tenant: z.string().regex(tenantRe, 'a tenant id is 1-63 of [a-z0-9_-], starting with a letter or digit'),
  ipHint: z.string().optional(),
  network: z.object({ id: z.string().regex(/^[a-z0-9][a-z0-9-]{0,62}$/), subnet: z.string() }).optional(),
  resume: z.boolean().optional(),
  expose: z.array(exposeSchema).max(64).optional(),
  env: z
    .record(
      z.string().regex(envKeyRe, 'an environment variable name'),
      z.string().refine((v) => !v.includes('\0'), 'no NUL bytes'),
    )
    .optional(),
  /** Keep CAP_NET_RAW (raw sockets: ping, packet capture); dropped by default. */
  net_raw: z.boolean().optional(),
  egress: sandboxEgressSchema.optional(),
});

export async function createSandbox(
  host: SandboxHost,
  input: CreateSpec,
  /** With resume: a post-copy restore, memory paged in by this daemon (criu-lazy.ts). */
  lazy?: NonNullable<Parameters<typeof restoreInto>[3]>['lazy'],
): Promise<SandboxInfo> {
  host.assertOpen();
  const parsed = createSpecSchema.safeParse(input);
  if (!parsed.success) {
    throw invalidSpec(
      `invalid sandbox spec: ${describeFields(fieldsFromZod(parsed.error, (p) => dottedPath(p) || '(spec)'))}`,
      fieldsFromZod(parsed.error),
    );
  }
  const spec = parsed.data;
  return host.locks.run(`sb:${spec.name}`, async () => {
    let image = spec.image ?? host.opts.defaultImage;
    let checkpointId = '';
    if (spec.checkpointId) {
      const cp = await host.checkpoints.get(spec.checkpointId);
      if (spec.image && spec.image !== cp.image) {
        throw invalidSpec(`checkpoint "${cp.id}" sits on image "${cp.image}", not "${spec.image}": omit image or name the checkpoint's`, [
          { path: 'image', message: 'conflicts with the checkpoint' },
        ]);
      }
      image = cp.image;
      checkpointId = cp.id;
      if (spec.resume) {
        host.requireCriu();
        if (cp.kind !== 'live') {
          throw new AppError('CHECKPOINT_NOT_LIVE', 409, `checkpoint "${cp.id}" holds no memory: it can boot a sandbox, not resume one`, {
            id: cp.id,
          });
        }
      }
    } else if (spec.resume) {
      throw invalidSpec('resume needs a checkpointId (a live checkpoint)', [{ path: 'resume', message: 'needs checkpointId' }]);
    }
    const imagePath = await resolveImage(host.opts.imageDir, image);
    // From here to records.set nothing awaits: the name, the slot and the address are taken atomically.
    if (host.records.has(spec.name)) throw sandboxExists(spec.name);
    if (host.records.size >= host.opts.maxSandboxes) {
      throw capacityExhausted(`${host.records.size} of ${host.opts.maxSandboxes} sandboxes are in use`, { max: host.opts.maxSandboxes });
    }
    const { ip, mac } = reserveAddress(
      host.subnet,
      spec.name,
      spec.network,
      spec.ipHint,
      [...host.records.values()].map((r) => r.state),
    );
    const state: Persisted = {
      version: 1,
      name: spec.name,
      status: 'creating',
      tenant: spec.tenant,
      image,
      checkpoint_id: checkpointId,
      ip,
      mac,
      bridge: allocateBridge(
        host.opts.bridgePrefix,
        bridgeKeyOf(spec),
        host.opts.allowCrossTenant && !spec.network,
        [...host.records.values()].map((r) => ({ tenant: bridgeKeyOf(r.state), bridge: r.state.bridge })),
      ),
      veth: allocateVeth(
        host.opts.bridgePrefix,
        [...host.records.values()].map((r) => r.state.veth),
      ),
      cpus: spec.cpus,
      ram_mb: spec.ram_mb,
      pids_max: spec.pids_max ?? host.opts.defaultPidsMax,
      storage_gb: spec.storage_gb ?? 0,
      created_at: new Date().toISOString(),
      init_pid: 0,
      init_start: '',
      env: spec.env ?? {},
      net_raw: spec.net_raw ?? false,
      uid_base: host.pickUidBase(),
      expose: spec.expose ?? [],
      host_ports: [],
      egress: spec.egress ?? NO_EGRESS,
      paused_checkpoint: '',
      ...(spec.network ? { network: spec.network } : {}),
    };
    Object.assign(state.env, host.egress.guestEnv(state.egress, ip));
    const record: SandboxRecord = { state, proxies: [] };
    host.records.set(spec.name, record);
    const t0 = performance.now();
    const phases: Record<string, number> = {};
    const mark = (phase: string): void => {
      phases[phase] = Math.round((performance.now() - t0) * 10) / 10;
    };
    // Started now, awaited before the bridge and veth exist: nft runs while the directories and cgroup are made.
    const firewallReady = host.firewall.apply(() => host.firewallState());
    firewallReady.catch(() => undefined);
    let bridged: Promise<void> | undefined;
    let diskSource: 'pool' | 'formatted' | 'none' = 'none';
    try {
      const dir = host.sandboxDir(spec.name);
      // A directory nobody owns (a crash between mkdir and state.json) is garbage.
      if (existsSync(join(dir, DISK_IMAGE))) await removeDisk(dir);
      await rm(dir, { recursive: true, force: true });
      await mkdir(join(dir, 'root'), { recursive: true });
      await host.persist(state);
      mark('dirs');
      // The tenant's bridge, once its rules exist, while the disk and cgroup are made (readyBridge skips its ip(8)
      // runs for a bridge this process set up).
      bridged = firewallReady.then(async () => {
        await host.readyBridge(record);
        await host.syncBridgeForwarding(state.bridge);
      });
      bridged.catch(() => undefined);
      const layer = layerDirs(dir, state.storage_gb);
      if (state.storage_gb > 0) {
        diskSource = (await host.disks.provide(dir, state.storage_gb)) ? 'pool' : 'formatted';
        if (diskSource === 'formatted') await createDisk(dir, state.storage_gb);
      } else for (const d of [layer.upper, layer.work]) await mkdir(d, { recursive: true });
      mark('disk');
      if (checkpointId) await host.checkpoints.extract(checkpointId, layer.upper);
      await host.cgroups.create(spec.name, { cpus: state.cpus, ramMb: state.ram_mb, pidsMax: state.pids_max });
      mark('cgroup');
      // The rules for this sandbox's bridge and port exist before either does.
      await firewallReady;
      mark('firewall');
      await bridged;
      if (usesAgentProxy(state.egress)) await host.egress.ensureProxy();
      mark('bridge');
      if (spec.resume) await restoreInto(host, record, await host.checkpoints.get(checkpointId), { lazy, networkReady: true });
      else await host.launch(record, imagePath, mark);
      mark('init');
      await host.persist(state);
      mark('network');
      await host.publish(record);
      state.status = 'running';
      await host.persist(state);
      mark('done');
    } catch (err) {
      // A restore's daemon still paging in (a step after the restore failed) goes with the sandbox.
      host.paging.forget(spec.name);
      // Settled first, so teardown's delete of the bridge cannot run before its add.
      await bridged?.catch(() => undefined);
      await teardownSandbox(host, record, {}).catch((e: unknown) =>
        host.log?.warn({ err: e, sandbox: spec.name }, 'cleanup after a failed create failed'),
      );
      throw err instanceof AppError
        ? err
        : sandboxFailed(`creating sandbox "${spec.name}" failed: ${(err as Error).message}`, { name: spec.name }, err);
    }
    host.log?.info({ sandbox: spec.name, ip, image, checkpoint: checkpointId || undefined }, 'sandbox created');
    host.log?.debug({ sandbox: spec.name, phases_ms: phases, disk: diskSource }, 'create timings');
    return host.info(record);
  });
}
