import { readdir, readFile, rm } from 'node:fs/promises';
import { join } from 'node:path';
import type { PruneReport, SandboxInfo } from '../../backend.js';
import { runTool } from '../process/exec-util.js';
import { qmp } from './qmp.js';
import { nameRe } from '../spec-rules.js';
import { publish } from './vm-boot.js';
import { listAllLinks } from './vm-network.js';
import type { QemuHost } from './vm-host.js';

/** Recovery after an agent restart and prune (backend.go.txt Reconcile). */

/** Rediscovers VMs from their state files; a QEMU still running keeps its VM, and its endpoints are published again. */
export async function recoverVms(qemu: QemuHost): Promise<SandboxInfo[]> {
  const names = await readdir(qemu.vmsDir).catch(() => [] as string[]);
  for (const name of names) {
    if (!nameRe.test(name) || qemu.records.has(name) || qemu.creating.has(name)) continue;
    const r = await qemu.readRecord(name);
    // Half-created VMs (the agent died mid-create) are left for prune.
    if (!r || r.state.status === 'creating') continue;
    qemu.records.set(name, r);
    if (r.state.status === 'running' && (await qemu.alive(r.state))) {
      const status = await qmp(qemu.qmpPath(name), 'query-status').catch(() => null);
      if (!status) qemu.log?.warn({ vm: name }, 'QEMU is alive but its QMP socket does not answer');
      await qemu.startConsole(r).catch((err: unknown) => qemu.log?.warn({ vm: name, err: (err as Error).message }, 'no serial console'));
      await publish(qemu, r).catch((err: unknown) =>
        qemu.log?.warn({ vm: name, err: (err as Error).message }, 'could not republish endpoints'),
      );
    }
  }
  if (qemu.records.size > 0) await qemu.firewall.apply(() => qemu.firewallState());
  return qemu.list();
}

export async function pruneVms(qemu: QemuHost): Promise<PruneReport> {
  const report = {
    bridges: [] as string[],
    veths: [] as string[],
    mounts: [] as string[],
    loopDevices: [] as string[],
    directories: [] as string[],
    cgroups: [] as string[],
    processes: [] as number[],
    tables: [] as string[],
    errors: [] as string[],
  };
  await qemu.locks.run('alloc', async () => {
    const known = [...qemu.records.values()].map((r) => r.state);
    // QEMUs of this agent (by their -pidfile under our vms dir) that no live VM owns.
    for (const p of await ourQemuProcesses(qemu)) {
      const owner = known.find((s) => s.name === p.name);
      if (owner && owner.pid === p.pid) continue;
      if (qemu.creating.has(p.name)) continue;
      try {
        process.kill(p.pid, 'SIGKILL');
        report.processes.push(p.pid);
      } catch (err) {
        report.errors.push(`kill ${p.pid}: ${(err as Error).message}`);
      }
    }
    for (const name of await readdir(qemu.vmsDir).catch(() => [] as string[])) {
      if (known.some((s) => s.name === name) || qemu.creating.has(name)) continue;
      await rm(qemu.vmDir(name), { recursive: true, force: true });
      report.directories.push(qemu.vmDir(name));
    }
    const sockets = new Set(known.flatMap((s) => [qemu.qmpPath(s.name), qemu.serialPath(s.name), qemu.controlPath(s.name)]));
    for (const n of qemu.creating) sockets.add(qemu.qmpPath(n)).add(qemu.serialPath(n)).add(qemu.controlPath(n));
    for (const f of await readdir(qemu.runDir).catch(() => [] as string[])) {
      const path = join(qemu.runDir, f);
      if (sockets.has(path)) continue;
      await rm(path, { force: true });
      report.directories.push(path);
    }
    const links = await listAllLinks();
    for (const l of links) {
      if (qemu.tapRe().test(l) && !known.some((s) => s.tap === l)) {
        if ((await runTool('ip', ['link', 'del', l])).code === 0) report.veths.push(l);
      }
    }
    for (const l of links) {
      if (qemu.bridgeRe().test(l) && !known.some((s) => s.bridge === l)) {
        if ((await runTool('ip', ['link', 'del', l])).code === 0) report.bridges.push(l);
      }
    }
    if (known.length === 0) {
      const had = await qemu.firewall.reassert(() => qemu.firewallState()).catch(() => [] as string[]);
      if (had.length > 0) report.tables.push(...qemu.firewall.tables);
    }
  });
  return report;
}

export async function ourQemuProcesses(qemu: QemuHost): Promise<Array<{ pid: number; name: string }>> {
  const out: Array<{ pid: number; name: string }> = [];
  for (const entry of await readdir('/proc').catch(() => [] as string[])) {
    if (!/^\d+$/.test(entry)) continue;
    const argv = (await readFile(`/proc/${entry}/cmdline`, 'utf8').catch(() => '')).split('\0');
    const i = argv.indexOf('-pidfile');
    const pidfile = i >= 0 ? argv[i + 1] : undefined;
    if (!pidfile?.startsWith(`${qemu.vmsDir}/`)) continue;
    const name = pidfile.slice(qemu.vmsDir.length + 1).split('/')[0] ?? '';
    out.push({ pid: Number(entry), name });
  }
  return out;
}
