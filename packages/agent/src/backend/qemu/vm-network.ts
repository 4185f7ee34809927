import type { NetworkReassertReport } from '../../backend.js';
import { mustRun, runTool } from '../process/exec-util.js';
import { ensureBridge, hardenLink } from '../process/network.js';
import type { VmState } from './vm-state.js';
import type { QemuHost } from './vm-host.js';

/** A VM's tap on its tenant's bridge, and the periodic reassertion of links and firewall. */

export async function plugNetwork(qemu: QemuHost, s: VmState): Promise<void> {
  const fresh = ![...qemu.records.values()].some((r) => r.state.name !== s.name && r.state.bridge === s.bridge);
  await ensureBridge(s.bridge, qemu.subnet, { fresh });
  await runTool('ip', ['link', 'del', s.tap]);
  await mustRun('ip', ['tuntap', 'add', 'dev', s.tap, 'mode', 'tap']);
  await hardenLink(s.tap, 'veth');
  await mustRun('ip', ['-batch', '-'], {
    input:
      [`link set ${s.tap} master ${s.bridge} up`, `route replace ${s.ip}/32 dev ${s.bridge} src ${qemu.subnet.gateway}`].join('\n') + '\n',
  });
}

export async function reassertNetwork(qemu: QemuHost): Promise<NetworkReassertReport> {
  const repairs: string[] = [];
  for (const r of qemu.records.values()) {
    repairs.push(...(await hardenLink(r.state.bridge, 'bridge')), ...(await hardenLink(r.state.tap, 'veth')));
  }
  repairs.push(...(await qemu.firewall.reassert(() => qemu.firewallState())));
  return { repaired: repairs.length, repairs };
}

export async function listAllLinks(): Promise<string[]> {
  const res = await runTool('ip', ['-j', 'link', 'show']);
  if (res.code !== 0) return [];
  try {
    return (JSON.parse(res.stdout) as Array<{ ifname: string }>).map((l) => l.ifname.replace(/@.*$/, ''));
  } catch {
    return [];
  }
}
