import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { REPO_ROOT } from '../agent/harness.js';

/**
 * The "internet" for egress tests and benches, made and removed by the test:
 * a network namespace joined to the host by a veth, holding addresses where
 * the internet would be (a random /28 of the documentation range
 * 198.51.100.0/24), plus a private one (192.168.x) and 169.254.169.254
 * (cloud metadata) so a test can tell "blocked" from "not there". Inside
 * it, node serves HTTP (:80), HTTPS (:443, self-signed for *.example.test)
 * and DNS (udp :53) answering the names given. The host reaches it by
 * routes; the host veth forwards (so replies to masqueraded sandbox traffic
 * come back), nothing global is touched.
 *
 * Every name starts with `prefix`; `remove()` deletes the namespace (its
 * end of the veth and its processes go with it) and the host veth, and is
 * also run at process exit.
 */
export interface TestInternet {
  readonly ns: string;
  /** The host's address on the veth (a host address: sandboxes must not reach it). */
  readonly hostIp: string;
  /** Two public-looking servers. */
  readonly ip1: string;
  readonly ip2: string;
  /** A private address (192.168/16) and the metadata address, both served. */
  readonly privateIp: string;
  readonly metadataIp: string;
  /** The DNS server's address (ip1). */
  readonly dns: string;
  remove(): void;
}

const live = new Set<() => void>();
process.once('exit', () => {
  for (const r of live) r();
});

const run = (cmd: string, args: string[]) => spawnSync(cmd, args, { encoding: 'utf8', timeout: 20_000 });
function must(cmd: string, args: string[]): void {
  const r = run(cmd, args);
  if (r.status !== 0) throw new Error(`${cmd} ${args.join(' ')}: ${r.stderr}`);
}

export async function startTestInternet(
  prefix: string,
  names: Record<string, 'ip1' | 'ip2' | 'private' | 'metadata'> = {},
): Promise<TestInternet> {
  const block = 16 * (1 + (randomBytes(1)[0]! % 14));
  const base = `198.51.100.`;
  const hostIp = `${base}${block + 1}`;
  const ip1 = `${base}${block + 2}`;
  const ip2 = `${base}${block + 3}`;
  const privateIp = `192.168.${200 + (randomBytes(1)[0]! % 50)}.${2 + (randomBytes(1)[0]! % 200)}`;
  const metadataIp = '169.254.169.254';
  const ns = `${prefix}inet`;
  const veth = `${prefix}ih`;
  let child: ChildProcess | undefined;
  const remove = (): void => {
    live.delete(remove);
    if (child && child.exitCode === null) child.kill('SIGKILL');
    run('ip', ['netns', 'del', ns]);
    run('ip', ['link', 'del', veth]);
  };
  live.add(remove);
  try {
    must('ip', ['netns', 'add', ns]);
    must('ip', ['link', 'add', veth, 'type', 'veth', 'peer', 'name', 'eth0', 'netns', ns]);
    must('ip', ['addr', 'add', `${hostIp}/28`, 'dev', veth]);
    must('ip', ['link', 'set', veth, 'up']);
    must('sh', ['-c', `echo 1 > /proc/sys/net/ipv4/conf/${veth}/forwarding`]);
    must('ip', ['route', 'add', `${privateIp}/32`, 'via', ip1, 'dev', veth]);
    // The metadata address is never routed on the host: a sandbox's packet to it must die in the prerouting drop,
    // and this route is what would carry it here if that drop were gone.
    // replace, not add: two test internets at once share this one address (the later one's route wins; its link going takes it).
    must('ip', ['route', 'replace', `${metadataIp}/32`, 'via', ip1, 'dev', veth]);
    must('ip', ['-n', ns, 'link', 'set', 'lo', 'up']);
    for (const a of [`${ip1}/28`, `${ip2}/28`, `${privateIp}/32`, `${metadataIp}/32`])
      must('ip', ['-n', ns, 'addr', 'add', a, 'dev', 'eth0']);
    must('ip', ['-n', ns, 'link', 'set', 'eth0', 'up']);
    must('ip', ['-n', ns, 'route', 'add', 'default', 'via', hostIp]);
    const addr = { ip1, ip2, private: privateIp, metadata: metadataIp };
    const map = Object.entries(names)
      .map(([n, which]) => `${n}=${addr[which]}`)
      .join(',');
    const fx = join(REPO_ROOT, 'test/agent/fixtures');
    child = spawn(
      'ip',
      [
        'netns',
        'exec',
        ns,
        process.execPath,
        join(fx, 'egress-internet.mjs'),
        join(fx, 'egress-internet.key'),
        join(fx, 'egress-internet.crt'),
        map,
      ],
      { stdio: ['ignore', 'pipe', 'pipe'] },
    );
    let err = '';
    child.stderr!.on('data', (d: Buffer) => (err += d.toString()));
    await new Promise<void>((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`the test internet did not start: ${err}`)), 15_000);
      child!.stdout!.on('data', (d: Buffer) => {
        if (d.toString().includes('ready')) {
          clearTimeout(timer);
          resolve();
        }
      });
      child!.once('exit', (code) => {
        clearTimeout(timer);
        reject(new Error(`the test internet exited (${code}): ${err}`));
      });
    });
  } catch (e) {
    remove();
    throw e;
  }
  return { ns, hostIp, ip1, ip2, privateIp, metadataIp, dns: ip1, remove };
}
