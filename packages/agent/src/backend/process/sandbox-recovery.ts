import { rm, readdir } from 'node:fs/promises';
import { join } from 'node:path';
import type { PruneReport, SandboxInfo } from '../../backend.js';
import { nameRe } from '../spec-rules.js';
import { usesAgentProxy } from './egress-host.js';
import { runTool } from './exec-util.js';
import { deleteLink, listLinks, listRoutes } from './network.js';
import type { SandboxHost } from './sandbox-host.js';
import { reassertNetwork } from './sandbox-network.js';
import type { SandboxRecord } from './sandbox-state.js';
import { teardownSandbox } from './sandbox-teardown.js';
import { DISK_IMAGE, DISK_MOUNT, mountDisk, mountPoints, pruneLoopDevices } from './storage.js';

/* What a (re)started agent finds on disk: sandboxes to take back, leftovers to remove. */

export async function recoverSandboxes(host: SandboxHost): Promise<SandboxInfo[]> {
  const names = await readdir(host.sandboxesDir).catch(() => [] as string[]);
  for (const name of names) {
    if (!nameRe.test(name) || host.records.has(name)) continue;
    await host.locks.run(`sb:${name}`, async () => {
      const state = await host.readState(name);
      if (!state) return; // not ours to judge here: prune() removes it
      const record: SandboxRecord = { state, proxies: [] };
      if (state.status === 'creating') {
        // The agent died mid-create: nothing was handed out, so undo it.
        await teardownSandbox(host, record, {}).catch((err: unknown) =>
          host.log?.warn({ err, sandbox: name }, 'could not undo a half-created sandbox'),
        );
        return;
      }
      host.records.set(name, record);
      // After a host reboot the disk is no longer mounted; the layer must stay reachable (checkpoint, destroy).
      if (state.storage_gb > 0)
        await mountDisk(host.sandboxDir(name)).catch((err: unknown) =>
          host.log?.warn({ err, sandbox: name }, 'could not mount the sandbox disk'),
        );
      if (await host.isAlive(state)) {
        // No freeze outlives the agent that took it: one killed mid-checkpoint left its guest frozen.
        await host.cgroups.setFrozen(name, false).catch((err: unknown) => host.log?.warn({ err, sandbox: name }, 'could not thaw'));
        await host.publish(record).catch((err: unknown) => host.log?.warn({ err, sandbox: name }, 'could not republish endpoints'));
        await host.persist(state);
      }
    });
  }
  const infos = await host.list();
  host.log?.info({ sandboxes: infos.length }, 'sandboxes recovered');
  const network = await reassertNetwork(host);
  if (network.repaired > 0) host.log?.warn({ repairs: network.repairs }, 'sandbox network rules repaired');
  if ([...host.records.values()].some((r) => usesAgentProxy(r.state.egress)))
    await host.egress.ensureProxy().catch((err: unknown) => host.log?.warn({ err }, 'the egress proxy did not start'));
  return infos;
}

export async function pruneHost(host: SandboxHost): Promise<PruneReport> {
  const report: PruneReport = {
    bridges: [],
    veths: [],
    mounts: [],
    loopDevices: [],
    directories: [],
    cgroups: [],
    processes: [],
    tables: [],
    errors: [],
  };
  const known = new Map([...host.records.values()].map((r) => [r.state.name, r.state]));
  const note = (what: string, err: unknown): void => {
    report.errors.push(`${what}: ${(err as { message?: string }).message ?? String(err)}`);
  };
  // Mounts under the data dir: by design every sandbox mount lives in the sandbox's own namespace.
  // The exception: a known sandbox's disk, which lives in the agent's namespace on purpose (storage.ts).
  const liveDisks = new Set([...known.values()].filter((s) => s.storage_gb > 0).map((s) => join(host.sandboxDir(s.name), DISK_MOUNT)));
  const mounts = [...(await mountPoints())]
    .filter((m) => (m === host.opts.dataDir || m.startsWith(`${host.opts.dataDir}/`)) && !liveDisks.has(m))
    .sort((a, b) => b.length - a.length);
  for (const m of mounts) {
    const res = await runTool('umount', ['-l', m]);
    if (res.code === 0) report.mounts.push(m);
    else note(`umount ${m}`, new Error(res.stderr.trim()));
  }
  for (const name of await host.cgroups.list()) {
    if (known.has(name)) continue;
    try {
      report.processes.push(...(await host.cgroups.remove(name)));
      report.cgroups.push(name);
    } catch (err) {
      note(`cgroup ${name}`, err);
    }
  }
  if (host.records.size === 0 && (await host.cgroups.removeParentIfEmpty())) report.cgroups.push(host.cgroups.parent);
  const loops = await pruneLoopDevices(host.sandboxesDir, new Set([...liveDisks].map((m) => join(m, '..', DISK_IMAGE))));
  report.loopDevices.push(...loops.detached);
  report.errors.push(...loops.errors);
  const dirs = await readdir(host.sandboxesDir).catch(() => [] as string[]);
  for (const name of dirs) {
    if (known.has(name)) continue;
    await host.locks.run(`sb:${name}`, async () => {
      if (host.records.has(name)) return;
      try {
        const state = await host.readState(name);
        if (state) await teardownSandbox(host, { state, proxies: [] }, {});
        else await rm(host.sandboxDir(name), { recursive: true, force: true });
        report.directories.push(host.sandboxDir(name));
      } catch (err) {
        note(`directory ${name}`, err);
      }
    });
  }
  if (host.records.size === 0) {
    // Superseded runtime directories (the host's busybox changed) are mounted by no sandbox once none runs.
    for (const entry of await readdir(host.opts.dataDir).catch(() => [] as string[])) {
      if (entry.startsWith('runtime.old-') || entry.startsWith('runtime.tmp-')) {
        await rm(join(host.opts.dataDir, entry), { recursive: true, force: true });
        report.directories.push(join(host.opts.dataDir, entry));
      }
    }
  }
  for (const entry of await readdir(host.checkpoints.dir).catch(() => [] as string[])) {
    if (entry.startsWith('.tmp-') || entry.startsWith('.del-')) {
      await rm(join(host.checkpoints.dir, entry), { recursive: true, force: true });
      report.directories.push(join(host.checkpoints.dir, entry));
    }
  }
  // CRIU dumps and restore scratch directories of an agent that died mid-way.
  for (const entry of await readdir(host.checkpoints.staging).catch(() => [] as string[])) {
    if ((entry.startsWith('.criu-') || entry.startsWith('.restore-')) && !host.scratch.has(entry)) {
      await rm(join(host.checkpoints.staging, entry), { recursive: true, force: true });
      report.directories.push(join(host.checkpoints.staging, entry));
    }
  }
  const prefix = host.opts.bridgePrefix;
  const liveVeths = new Set([...host.records.values()].map((r) => r.state.veth));
  for (const veth of await listLinks('veth')) {
    if (veth.startsWith(`${prefix}v`) && !liveVeths.has(veth)) {
      if (await deleteLink(veth)) report.veths.push(veth);
      else note(`veth ${veth}`, new Error('ip link del failed'));
    }
  }
  const liveBridges = new Set([...host.records.values()].map((r) => r.state.bridge));
  const liveIps = new Set([...host.records.values()].map((r) => r.state.ip));
  for (const bridge of await listLinks('bridge')) {
    if (!bridge.startsWith(`${prefix}b`)) continue;
    await host.locks.run(`br:${bridge}`, async () => {
      if (!liveBridges.has(bridge) && ![...host.records.values()].some((r) => r.state.bridge === bridge)) {
        host.bridgesReady.delete(bridge);
        if (await deleteLink(bridge)) report.bridges.push(bridge);
        else note(`bridge ${bridge}`, new Error('ip link del failed'));
        return;
      }
      for (const ip of await listRoutes(bridge)) {
        if (!liveIps.has(ip)) await runTool('ip', ['route', 'del', `${ip}/32`, 'dev', bridge]);
      }
    });
  }
  // No sandbox left: the tables go too (reassert does the same).
  if (host.records.size === 0) {
    await host.firewall
      .reassert(() => host.firewallState())
      .then(
        (removed) => removed.length > 0 && report.tables.push(...host.firewall.tables),
        (err: unknown) => note('nftables', err),
      );
  }
  host.log?.info({ report }, 'prune finished');
  return report;
}
