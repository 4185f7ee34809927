import { existsSync } from 'node:fs';
import { featureMissing, sandboxFailed } from '../../backend.js';
import { runTool } from './exec-util.js';
import {
  bridgeEgressLines,
  egressChains,
  forwardReplyLines,
  inputEgressLines,
  natChain,
  type EgressHostConfig,
  type EgressPort,
} from './egress.js';

/**
 * The agent's nftables tables: the network boundary that does not depend on
 * a sysctl staying put (writing net.ipv4.ip_forward=1 resets every
 * per-interface `forwarding` back to 1, and a sysctl reload or Docker
 * starting does exactly that).
 *
 * Two tables per agent, named after the bridge prefix so that agents on one
 * machine never touch each other's (`inet fleet_<prefix>`, `bridge
 * fleet_<prefix>`). Both are derived from the sandboxes the agent knows and
 * replaced whole in one `nft -f` transaction (declare, delete, define), so
 * there is never a moment with half a ruleset, and applying twice is a
 * no-op. No sandbox left: no tables (and no conntrack hooks on the host).
 *
 * inet (layer 3, what reaches the host's IP stack from a sandbox bridge):
 * - prerouting, before any DNAT: every IPv6 packet and everything to
 *   169.254.0.0/16 (cloud metadata) is dropped.
 * - input: only replies to connections the host opened (endpoint proxies,
 *   in-guest agents reached through them) are accepted; anything a sandbox
 *   starts towards a host address, the gateway included, is dropped. The
 *   agent serves nothing to sandboxes over the network.
 * - forward: each bridge jumps to its own chain `br_<bridge>`, which lets a
 *   frame stay on its bridge (br_netfilter hands bridged IPv4 to these hooks
 *   with the bridge as both interfaces) and drops the rest; nothing from
 *   elsewhere is routed into a sandbox bridge. Egress (egress.ts: NAT,
 *   allow and deny lists, per sandbox) joins as rules in the per-bridge
 *   chains, ahead of the drop.
 * bridge (layer 2, every frame a sandbox port sends, bridged or not):
 * - each port jumps to its own chain `port_<veth>`: only its own MAC, only
 *   IPv4 from its own address and ARP about its own address and MAC; no
 *   IPv6, no VLAN tags, no other ethertype. Sandboxes keep CAP_NET_RAW, and
 *   this is what makes a packet's source address trustworthy upstream (a
 *   per-sandbox L3 policy can key on `ip saddr`).
 */

export interface FirewallPort {
  readonly veth: string;
  readonly mac: string;
  readonly ip: string;
}

export interface FirewallState {
  readonly bridges: readonly string[];
  readonly ports: readonly FirewallPort[];
  /** Outbound policies (egress.ts); absent: nothing leaves any bridge. */
  readonly egress?: { readonly cfg: EgressHostConfig; readonly ports: readonly EgressPort[] } | undefined;
}

const ifnameRe = /^[a-z0-9]{1,15}$/;
const macRe = /^[0-9a-f]{2}(:[0-9a-f]{2}){5}$/;
const ipRe = /^\d{1,3}(\.\d{1,3}){3}$/;

/** `nft`, or HOST_FEATURE_MISSING naming the Debian package. */
export function findNft(): string {
  for (const dir of ['/usr/sbin', '/usr/bin', '/sbin', '/bin']) {
    if (existsSync(`${dir}/nft`)) return `${dir}/nft`;
  }
  throw featureMissing('nft', 'install nftables (apt-get install nftables): the sandbox network boundary is an nftables ruleset');
}

export class Firewall {
  readonly tables: readonly string[];
  private readonly name: string;
  /** Serializes every nft call: a reassert must never interleave with an apply. */
  private tail: Promise<unknown> = Promise.resolve();
  /**
   * What `nft -s list ruleset` showed of our tables after the last reassert;
   * undefined once a create or destroy has applied since (listing after every
   * apply would cost each of them a second nft run).
   */
  private expected: string | undefined;
  /** The script of the last apply that succeeded (undefined while one runs or after one failed). */
  private applied: string | undefined;
  /** What the reassert behind an apply with nothing to apply repaired (the owner logs it). */
  onRepairs: ((repairs: string[]) => void) | undefined;

  private constructor(
    private readonly nft: string,
    prefix: string,
  ) {
    this.name = `fleet_${prefix}`;
    this.tables = [`inet ${this.name}`, `bridge ${this.name}`];
  }

  /** Finds nft and has the kernel check (without applying) a ruleset of the shape this agent uses. */
  static async open(prefix: string): Promise<Firewall> {
    const fw = new Firewall(findNft(), prefix);
    const probe = fw.render({
      bridges: [`${prefix}b0`],
      ports: [{ veth: `${prefix}v0`, mac: '02:00:00:00:00:01', ip: '10.0.0.2' }],
      egress: {
        cfg: { subnet: '10.0.0.0/24', gateway: '10.0.0.1', proxyPort: 3128, allowPrivate: [] },
        ports: [
          {
            ip: '10.0.0.2',
            veth: `${prefix}v0`,
            bridge: `${prefix}b0`,
            egress: { mode: 'direct', allow_out: ['10.1.0.0/16'], deny_out: [] },
          },
          { ip: '10.0.0.3', veth: `${prefix}v1`, bridge: `${prefix}b0`, egress: { mode: 'proxy', allow_out: [], deny_out: [] } },
        ],
      },
    });
    const res = await runTool(fw.nft, ['-c', '-f', '-'], { input: probe });
    if (res.code !== 0) {
      throw featureMissing(
        'nf_tables',
        `the kernel refused the agent's nftables ruleset (inet and bridge families, ct state, vmap): ${res.stderr.trim().slice(0, 300)}`,
      );
    }
    return fw;
  }

  /** Replaces both tables with what `state()` (read under the lock, so the newest wins) asks for. */
  apply(state: () => FirewallState): Promise<void> {
    return this.locked(async () => {
      const script = this.script(state());
      // What was applied last, unchanged (a resume: a paused sandbox's rules stay): no nft run for the caller to
      // wait on. The tables may have been changed behind the agent's back since (a host firewall reload): a
      // reassert, queued behind this call and not waited for, puts them back and reports what it repaired.
      if (script === this.applied) {
        void this.reassert(state).then(
          (repairs) => {
            if (repairs.length > 0) this.onRepairs?.(repairs);
          },
          () => undefined,
        );
        return;
      }
      this.expected = undefined;
      await this.applyNow(script);
    });
  }

  /** Re-applies when our tables are missing or differ from what was applied; returns one line per repair. */
  reassert(state: () => FirewallState): Promise<string[]> {
    return this.locked(async () => {
      const want = state();
      const empty = want.bridges.length === 0 && want.ports.length === 0;
      const listing = await this.listOurs();
      const repairs: string[] = [];
      if (empty) {
        if (listing !== '') repairs.push(`nftables tables ${this.tables.join(', ')} present with no sandbox: removed`);
      } else {
        for (const t of this.tables) if (!listing.includes(`table ${t} {`)) repairs.push(`nftables table ${t} missing`);
        if (repairs.length === 0 && this.expected !== undefined && listing !== this.expected)
          repairs.push(`nftables tables ${this.tables.join(', ')} changed`);
      }
      // No expectation (an apply since the last check): apply anyway, uncounted. A table edited in that
      // window is repaired here but not counted; a missing one is always counted.
      if (repairs.length > 0 || (this.expected === undefined && !empty)) {
        await this.applyNow(this.script(want));
        this.expected = await this.listOurs();
      } else {
        this.expected = listing;
      }
      return repairs;
    });
  }

  render(state: FirewallState): string {
    const bridges = [...new Set(state.bridges)].sort();
    const ports = [...state.ports].sort((a, b) => a.veth.localeCompare(b.veth));
    for (const b of bridges) if (!ifnameRe.test(b)) throw sandboxFailed(`refusing to write a firewall rule for bridge name "${b}"`);
    for (const p of ports) {
      if (!ifnameRe.test(p.veth) || !macRe.test(p.mac) || !ipRe.test(p.ip))
        throw sandboxFailed(`refusing to write a firewall rule for port ${JSON.stringify(p)}`);
    }
    const t = this.name;
    const eg = state.egress ?? { cfg: undefined, ports: [] };
    for (const p of eg.ports) {
      if (!ifnameRe.test(p.veth) || !ipRe.test(p.ip) || (p.egress.endpoint && !ipRe.test(p.egress.endpoint.host)))
        throw sandboxFailed(`refusing to write an egress rule for ${JSON.stringify(p)}`);
    }
    const set = (names: readonly string[]): string =>
      names.length > 0
        ? `    set bridges { type ifname; elements = { ${names.map((n) => `"${n}"`).join(', ')} } }`
        : '    set bridges { type ifname; }';
    const vmap = (names: readonly string[], chain: (n: string) => string, match: string): string[] =>
      names.length > 0 ? [`        ${match} vmap { ${names.map((n) => `"${n}" : jump ${chain(n)}`).join(', ')} }`] : [];
    const inet = [
      `table inet ${t} {`,
      set(bridges),
      '    chain prerouting {',
      '        type filter hook prerouting priority raw; policy accept;',
      '        iifname @bridges meta nfproto ipv6 drop',
      '        iifname @bridges ip daddr 169.254.0.0/16 drop',
      '    }',
      '    chain input {',
      '        type filter hook input priority filter - 10; policy accept;',
      '        iifname @bridges ct state established,related accept',
      ...(eg.cfg ? inputEgressLines(eg.cfg, eg.ports) : []),
      '        iifname @bridges drop',
      '    }',
      '    chain forward {',
      '        type filter hook forward priority filter - 10; policy accept;',
      ...vmap(bridges, (n) => `br_${n}`, 'iifname'),
      ...forwardReplyLines(eg.ports),
      '        oifname @bridges drop',
      '    }',
      ...bridges.flatMap((n) => [
        `    chain br_${n} {`,
        `        oifname "${n}" accept`,
        ...bridgeEgressLines(n, eg.ports),
        '        drop',
        '    }',
      ]),
      ...(eg.cfg ? [...egressChains(eg.cfg, eg.ports), ...natChain(eg.cfg, eg.ports)] : []),
      '}',
    ];
    const bridge = [
      `table bridge ${t} {`,
      '    chain prerouting {',
      '        type filter hook prerouting priority -300; policy accept;',
      ...vmap(
        ports.map((p) => p.veth),
        (n) => `port_${n}`,
        'iifname',
      ),
      '    }',
      ...ports.flatMap((p) => [
        `    chain port_${p.veth} {`,
        `        ether saddr != ${p.mac} drop`,
        '        ether type != { ip, arp } drop',
        `        ether type ip ip saddr != ${p.ip} drop`,
        `        ether type arp arp saddr ip != ${p.ip} drop`,
        `        ether type arp arp saddr ether != ${p.mac} drop`,
        '        accept',
        '    }',
      ]),
      '}',
    ];
    return [...this.replace(), ...inet, ...bridge].join('\n') + '\n';
  }

  private replace(): string[] {
    // Declaring first makes the delete valid whether or not the table exists; all of it is one transaction.
    return this.tables.flatMap((tbl) => [`table ${tbl} {}`, `delete table ${tbl}`]);
  }

  private script(state: FirewallState): string {
    const empty = state.bridges.length === 0 && state.ports.length === 0;
    return empty ? this.replace().join('\n') + '\n' : this.render(state);
  }

  private async applyNow(script: string): Promise<void> {
    this.applied = undefined;
    const res = await runTool(this.nft, ['-f', '-'], { input: script });
    if (res.code !== 0) throw sandboxFailed(`applying the sandbox firewall (nft) failed: ${res.stderr.trim().slice(0, 500)}`);
    this.applied = script;
  }

  /** Our two tables as `nft -s list ruleset` prints them (stateless, so no counters), '' when neither exists. */
  private async listOurs(): Promise<string> {
    const res = await runTool(this.nft, ['-s', 'list', 'ruleset']);
    if (res.code !== 0) throw sandboxFailed(`listing the nftables ruleset failed: ${res.stderr.trim().slice(0, 500)}`);
    const lines = res.stdout.split('\n');
    const out: string[] = [];
    let inside = false;
    for (const line of lines) {
      if (!inside && !this.tables.some((tbl) => line === `table ${tbl} {`)) continue;
      inside = true;
      out.push(line);
      if (line === '}') inside = false;
    }
    return out.join('\n');
  }

  private locked<T>(fn: () => Promise<T>): Promise<T> {
    const next = this.tail.then(fn, fn);
    this.tail = next.catch(() => undefined);
    return next;
  }
}
