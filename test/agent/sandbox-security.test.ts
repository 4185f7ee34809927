import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Readable } from 'node:stream';
import { after, before, describe, test } from 'node:test';
import { ProcessBackend, type ProcessBackendOptions } from '../../packages/agent/src/backend/process/process-backend.js';
import { buildImage } from '../../packages/agent/src/images.js';
import { startAgent, uniquePrefix, uniqueSubnet, type RunningAgent } from './harness.js';
import { collect, type Ran } from '../support/process.js';

/**
 * Attacks on the sandbox boundary (issue 13, deliverables 1-3), each
 * against real sandboxes:
 * - the tenant's environment (LD_PRELOAD, a PATH into the sandbox's layer
 *   on the host) reaches no host-side process, for piped exec and both TTY
 *   implementations, yet still works for the guest's own processes;
 * - sandbox root is not host root (user namespace);
 * - keyctl, bpf, unshare(CLONE_NEWUSER) refused with EPERM; no_new_privs
 *   and a seccomp filter on every guest process; CAP_NET_RAW only on request;
 * - runc's masked and read-only /proc and /sys paths;
 * - no guest process can exempt itself from the OOM killer.
 */

function missingFeature(): string | undefined {
  if (process.platform !== 'linux') return 'Linux (namespaces)';
  if (process.getuid?.() !== 0) return 'root';
  if (!existsSync('/bin/busybox')) return 'busybox-static';
  if (spawnSync('sh', ['-c', 'command -v gcc']).status !== 0) return 'gcc (the sandbox helper and the probe are compiled)';
  return undefined;
}
const skip = missingFeature();

/** CAP_SYS_RESOURCE (bit 24) in this process's effective set: without it no process on this host has a negative OOM floor. */
function hasSysResource(): boolean {
  const eff = /CapEff:\s+([0-9a-f]+)/.exec(spawnSync('cat', ['/proc/self/status'], { encoding: 'utf8' }).stdout);
  return eff !== null && (BigInt(`0x${eff[1]}`) & (1n << 24n)) !== 0n;
}
const noSysResource = hasSysResource() ? undefined : 'the host gives no CAP_SYS_RESOURCE (a container): no negative OOM floor exists here';

const PROBE_C = `
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <linux/bpf.h>
static void show(const char *what, long r) { printf("%s=%s\\n", what, r < 0 ? strerrorname_np(errno) : "OK"); }
int main(void) {
  show("keyctl", syscall(SYS_keyctl, 0 /* KEYCTL_GET_KEYRING_ID */, -3 /* session */, 1));
  show("add_key", syscall(SYS_add_key, "user", "fleet-probe", "x", 1, -3));
  union bpf_attr a; memset(&a, 0, sizeof a); a.map_type = BPF_MAP_TYPE_ARRAY; a.key_size = 4; a.value_size = 4; a.max_entries = 1;
  show("bpf", syscall(SYS_bpf, BPF_MAP_CREATE, &a, sizeof a));
  show("unshare_user", unshare(CLONE_NEWUSER));
  show("perf_event_open", syscall(SYS_perf_event_open, NULL, 0, -1, -1, 0));
  return 0;
}
`;

async function sh(b: ProcessBackend, name: string, script: string, env?: Record<string, string>): Promise<Ran> {
  return collect(await b.spawn(name, { argv: ['/bin/sh', '-c', script], stdin: false, ...(env ? { env } : {}) }));
}

describe('sandbox security boundary', { skip: skip ? `host feature missing: ${skip}` : false, timeout: 240_000 }, () => {
  let root: string;
  const backends: ProcessBackend[] = [];
  let b: ProcessBackend;
  let probe: Buffer;

  async function openBackend(extra: Partial<ProcessBackendOptions> = {}): Promise<ProcessBackend> {
    const options: ProcessBackendOptions = {
      dataDir: await mkdtemp(join(root, 'data-')),
      imageDir: join(root, 'images'),
      subnet: `10.${250 + (randomBytes(1)[0]! % 5)}.${randomBytes(1)[0]!}.0/24`,
      bridgePrefix: `s${randomBytes(2).toString('hex')}`,
      maxSandboxes: 8,
      ...extra,
    };
    const backend = await ProcessBackend.open(options);
    backends.push(backend);
    return backend;
  }

  before(async () => {
    root = await mkdtemp(join(tmpdir(), 'sec-test-'));
    await buildImage(join(root, 'images'), 'base');
    await writeFile(join(root, 'probe.c'), PROBE_C);
    const cc = spawnSync('gcc', ['-static', '-O1', '-o', join(root, 'probe'), join(root, 'probe.c')], { encoding: 'utf8' });
    assert.equal(cc.status, 0, cc.stderr);
    probe = await readFile(join(root, 'probe'));
    b = await openBackend();
  });

  after(async () => {
    for (const backend of backends) {
      for (const s of await backend.list().catch(() => [])) await backend.destroy(s.name).catch(() => undefined);
      await backend.prune().catch(() => undefined);
      await backend.close().catch(() => undefined);
    }
    await rm(root, { recursive: true, force: true });
  });

  /**
   * A directory in the sandbox's writable layer, reached from the host by
   * the path a tenant can work out (the layer's host path): every name a
   * host-side helper might look up in PATH, each leaving a marker on the
   * host when run there.
   */
  async function plantHostPathTraps(backend: ProcessBackend, name: string): Promise<{ hostPath: string; marker: string }> {
    const marker = join(root, `marker-${name}`);
    const names = ['sh', 'stty', 'setpriv', 'nsenter', 'busybox', 'script', 'env', 'unshare', 'cat', 'ip', 'tar'];
    const trap = `#!/bin/sh\necho "$0" >> ${marker}\nexit 0\n`;
    const made = await sh(
      backend,
      name,
      `mkdir -p /trap /guestbin && for n in ${names.join(' ')}; do printf '%s' "$TRAP" > /trap/$n && chmod 755 /trap/$n; done
printf '#!/bin/sh\\necho guest-path-works "$LD_PRELOAD"\\n' > /guestbin/guest-cmd && chmod 755 /guestbin/guest-cmd`,
      { TRAP: trap },
    );
    assert.equal(made.exitCode, 0, made.stderr);
    return { hostPath: join(backend.sandboxDir(name), 'upper', 'trap'), marker };
  }

  const hostileEnv = (hostPath: string): Record<string, string> => ({
    LD_PRELOAD: '/nonexistent-probe.so',
    LD_LIBRARY_PATH: hostPath,
    PATH: `/guestbin:${hostPath}:/usr/sbin:/usr/bin:/sbin:/bin`,
  });

  test('piped exec: LD_PRELOAD and a PATH into the sandbox reach no host-side process, and still work inside', async () => {
    await b.create({ name: 'env-piped', cpus: 1, ram_mb: 64, tenant: 'acme' });
    const { hostPath, marker } = await plantHostPathTraps(b, 'env-piped');
    const r = await collect(await b.spawn('env-piped', { argv: ['guest-cmd'], stdin: false, env: hostileEnv(hostPath) }));
    assert.equal(r.exitCode, 0, r.stderr);
    assert.equal(r.stdout, 'guest-path-works /nonexistent-probe.so\n', 'the guest resolves its own PATH and sees its LD_PRELOAD');
    assert.doesNotMatch(r.stderr, /ld\.so|LD_PRELOAD|cannot be preloaded/, 'a host-side process honoured the tenant LD_PRELOAD');
    assert.ok(
      !existsSync(marker),
      `a host-side process ran a program from the tenant's PATH: ${existsSync(marker) ? await readFile(marker, 'utf8') : ''}`,
    );
    await b.destroy('env-piped');
  });

  for (const pty of ['auto', 'script'] as const) {
    test(`tty exec (${pty === 'auto' ? 'node-pty' : 'script(1) fallback'}): no host-side process sees the tenant environment`, async () => {
      const backend = pty === 'script' ? await openBackend({ pty: 'script' }) : b;
      const name = `env-tty-${pty}`;
      await backend.create({ name, cpus: 1, ram_mb: 64, tenant: 'acme' });
      const { hostPath, marker } = await plantHostPathTraps(backend, name);
      const h = await backend.spawn(name, {
        argv: ['/bin/sh', '-c', 'guest-cmd; stty size; exit 3'],
        stdin: true,
        tty: { rows: 33, cols: 101 },
        env: hostileEnv(hostPath),
      });
      const r = await collect(h);
      assert.ok(
        !existsSync(marker),
        `a host-side process ran a program from the tenant's PATH: ${existsSync(marker) ? await readFile(marker, 'utf8') : ''}`,
      );
      assert.doesNotMatch(r.stdout + r.stderr, /ld\.so|cannot be preloaded/, 'a host-side process honoured the tenant LD_PRELOAD');
      assert.equal(r.exitCode, 3);
      assert.match(r.stdout, /guest-path-works \/nonexistent-probe\.so/);
      assert.match(r.stdout, /33 101/, 'the pty has the asked size');
      await backend.destroy(name);
    });
  }

  test('through the agent API: exec and a TTY attach with LD_PRELOAD and a PATH into the layer reach no host-side process', async () => {
    let agent: RunningAgent | undefined;
    try {
      agent = await startAgent(
        {
          dataDir: await mkdtemp(join(root, 'agent-')),
          imageDir: join(root, 'images'),
          subnet: uniqueSubnet(),
          bridgePrefix: uniquePrefix(),
          env: { AGENT_LOG_LEVEL: 'warn' },
        },
        60_000,
      );
      await agent.client.createVm({ name: 'api', image: 'base' });
      const hostUpper = join(agent.opts.dataDir, 'sandboxes', 'api', 'upper');
      const marker = join(root, 'marker-api');
      const plant = await agent.client.exec('api', {
        argv: [
          '/bin/sh',
          '-c',
          `mkdir -p /trap && for n in sh stty setpriv nsenter busybox script env; do printf '#!/bin/sh\necho "$0" >> ${marker}\n' > /trap/$n; chmod 755 /trap/$n; done`,
        ],
      });
      assert.equal(plant.exit_code, 0, plant.stderr);
      const env = hostileEnv(join(hostUpper, 'trap'));
      const r = await agent.client.exec('api', { argv: ['/bin/sh', '-c', 'echo "in:$LD_PRELOAD"'], env });
      assert.doesNotMatch(r.stderr, /ld\.so|cannot be preloaded/, 'a host-side process honoured the tenant LD_PRELOAD');
      assert.equal(r.stdout, 'in:/nonexistent-probe.so\n');
      const s = await agent.client.attach('api', {
        type: 'start',
        cmd: ['/bin/sh', '-c', 'stty size; echo "in:$LD_PRELOAD"; exit 5'],
        tty: true,
        rows: 31,
        cols: 99,
        env,
      });
      let out = '';
      let code: number | undefined;
      for await (const f of s.frames) {
        if (f.type === 'stdout' || f.type === 'stderr') out += Buffer.from(f.data, 'base64').toString();
        if (f.type === 'exit') code = f.code ?? undefined;
      }
      s.close();
      assert.ok(
        !existsSync(marker),
        `a host-side process ran a program from the tenant's PATH: ${existsSync(marker) ? await readFile(marker, 'utf8') : ''}`,
      );
      assert.doesNotMatch(out, /ld\.so|cannot be preloaded/);
      assert.match(out, /31 99[\s\S]*in:\/nonexistent-probe\.so/);
      assert.equal(code, 5);
      await agent.client.destroyVm('api', { force: true });
    } finally {
      await agent?.stop();
      await agent?.cleanupHost();
    }
  });

  test('seccomp: keyctl, add_key, bpf, perf_event_open and unshare(CLONE_NEWUSER) fail with EPERM; no_new_privs and filter set', async () => {
    await b.create({ name: 'sc', cpus: 1, ram_mb: 64, tenant: 'acme' });
    await b.writeGuestFile('sc', '/probe', Readable.from([probe]), { mode: 0o755 });
    const r = await sh(b, 'sc', '/probe; unshare -U true; echo "unshare-exit=$?"; grep -E "^(NoNewPrivs|Seccomp):" /proc/self/status');
    assert.match(r.stdout, /keyctl=EPERM/);
    assert.match(r.stdout, /add_key=EPERM/);
    assert.match(r.stdout, /bpf=EPERM/);
    assert.match(r.stdout, /perf_event_open=EPERM/);
    assert.match(r.stdout, /unshare_user=EPERM/);
    assert.match(r.stdout, /unshare-exit=1/);
    assert.match(r.stderr, /Operation not permitted/);
    assert.match(r.stdout, /NoNewPrivs:\s+1/);
    assert.match(r.stdout, /Seccomp:\s+2/);
    // The init (and so every daemon it starts) is confined the same way.
    const init = await sh(b, 'sc', 'grep -E "^(NoNewPrivs|Seccomp):" /proc/1/status');
    assert.match(init.stdout, /NoNewPrivs:\s+1\nSeccomp:\s+2/);
    await b.destroy('sc');
  });

  test('CAP_NET_RAW only when the spec asks for it', async () => {
    const NET_RAW = 13n;
    const capEff = async (name: string): Promise<bigint> =>
      BigInt(`0x${/CapEff:\s+([0-9a-f]+)/.exec((await sh(b, name, 'cat /proc/self/status')).stdout)![1]}`);
    await b.create({ name: 'raw-no', cpus: 1, ram_mb: 64, tenant: 'acme' });
    await b.create({ name: 'raw-yes', cpus: 1, ram_mb: 64, tenant: 'acme', net_raw: true });
    assert.equal((await capEff('raw-no')) & (1n << NET_RAW), 0n, 'CAP_NET_RAW kept without net_raw');
    assert.notEqual((await capEff('raw-yes')) & (1n << NET_RAW), 0n, 'net_raw: true did not keep CAP_NET_RAW');
    const ping = await sh(b, 'raw-no', 'ping -c 1 -W 1 127.0.0.1');
    assert.notEqual(ping.exitCode, 0, 'a raw socket opened without CAP_NET_RAW');
    assert.equal((await sh(b, 'raw-yes', 'ping -c 1 -W 1 127.0.0.1')).exitCode, 0);
    await b.destroy('raw-no');
    await b.destroy('raw-yes');
  });

  test('masked /proc and /sys paths read as empty, read-only ones refuse writes', async () => {
    await b.create({ name: 'masks', cpus: 1, ram_mb: 64, tenant: 'acme' });
    const r = await sh(
      b,
      'masks',
      `for f in /proc/kcore /proc/keys /proc/timer_list /proc/sched_debug; do [ -e $f ] && echo "$f $(cat $f 2>/dev/null | wc -c)"; done
for d in /proc/acpi /proc/scsi /sys/firmware /sys/devices/virtual/powercap; do [ -d $d ] && echo "$d $(ls -A $d | wc -l)"; done
echo 1 > /proc/sysrq-trigger 2>/dev/null && echo SYSRQ-WRITABLE
echo 1 > /proc/sys/kernel/sysrq 2>/dev/null && echo SYSCTL-WRITABLE
for p in /proc/bus /proc/fs /proc/irq /proc/sys /proc/sysrq-trigger; do grep -q " $p ro," /proc/self/mountinfo && echo "$p ro"; done
true`,
    );
    for (const line of r.stdout
      .trim()
      .split('\n')
      .filter((l) => /^\/(proc|sys)\/\S+ \d+$/.test(l))) {
      assert.match(line, / 0$/, `masked path has content: ${line}`);
    }
    assert.match(r.stdout, /\/proc\/keys 0/);
    assert.match(r.stdout, /\/proc\/timer_list 0/);
    assert.doesNotMatch(r.stdout, /WRITABLE/);
    for (const p of ['/proc/bus', '/proc/fs', '/proc/irq', '/proc/sys', '/proc/sysrq-trigger']) {
      if (existsSync(p)) assert.match(r.stdout, new RegExp(`${p} ro`), `${p} is not mounted read-only`);
    }
    if (existsSync('/sys/firmware')) {
      // A masked directory is a read-only, nosuid, nodev, noexec bind of an empty directory of this sandbox's own:
      // one shared by two sandboxes would let one watch (inotify) the other list it.
      await b.create({ name: 'masks2', cpus: 1, ram_mb: 64, tenant: 'other' });
      const seen = await Promise.all(
        ['masks', 'masks2'].map(
          async (n) => (await sh(b, n, "stat -c %d:%i /sys/firmware; grep ' /sys/firmware ' /proc/self/mountinfo")).stdout,
        ),
      );
      for (const s of seen) assert.match(s, / \/sys\/firmware ro,nosuid,nodev,noexec/, s);
      assert.notEqual(seen[0]!.split('\n')[0], seen[1]!.split('\n')[0], 'two sandboxes share the inode of a masked directory');
      await b.destroy('masks2');
    }
    await b.destroy('masks');
  });

  test('user namespace: sandbox root is an unprivileged host id, its files are root-owned inside and on disk', async () => {
    await b.create({ name: 'userns', cpus: 1, ram_mb: 64, tenant: 'acme' });
    const r = await sh(
      b,
      'userns',
      'cat /proc/self/uid_map /proc/self/gid_map; id -u; touch /made-inside; stat -c %u:%g /made-inside /bin/busybox',
    );
    const [uidMap, gidMap] = r.stdout.split('\n').map((l) => l.trim().split(/\s+/).map(Number));
    assert.equal(uidMap![0], 0);
    assert.ok(uidMap![1]! > 0, `sandbox root is host uid ${uidMap![1]}`);
    assert.equal(uidMap![2], 65536);
    assert.ok(gidMap![1]! > 0);
    assert.match(r.stdout, /\n0\n0:0\n0:0\n$/, 'image and new files are root-owned inside');
    // On the host the sandbox's processes are that unprivileged id, and the layer records plain 0 (range-independent).
    const initUid = /Uid:\s+(\d+)/.exec(await readFile(`/proc/${(await b.get('userns')).init_pid}/status`, 'utf8'))![1];
    assert.equal(Number(initUid), uidMap![1]);
    const st = spawnSync('stat', ['-c', '%u', join(b.sandboxDir('userns'), 'upper', 'made-inside')], { encoding: 'utf8' });
    assert.equal(st.stdout.trim(), '0');
    await b.destroy('userns');
  });

  test('a checkpoint restores under another id block with the same ownership inside', async () => {
    await b.create({ name: 'cp-src', cpus: 1, ram_mb: 64, tenant: 'acme' });
    const made = await sh(
      b,
      'cp-src',
      'mkdir -p /home/u && touch /home/u/f /rootfile && chown -R 1000:1000 /home/u && rm /etc/hosts && cat /proc/self/uid_map',
    );
    assert.equal(made.exitCode, 0, made.stderr);
    const cp = await b.checkpoint('cp-src', { comment: 'userns' });
    await b.create({ name: 'cp-dst', cpus: 1, ram_mb: 64, tenant: 'acme', checkpointId: cp.id });
    const r = await sh(
      b,
      'cp-dst',
      'stat -c "%n %u:%g" /home/u/f /rootfile /bin/busybox; [ -e /etc/hosts ] || echo hosts-deleted; cat /proc/self/uid_map',
    );
    assert.match(r.stdout, /\/home\/u\/f 1000:1000\n\/rootfile 0:0\n\/bin\/busybox 0:0\nhosts-deleted\n/);
    assert.notEqual(
      r.stdout.split('hosts-deleted\n')[1]!.trim().split(/\s+/)[1],
      made.stdout.trim().split(/\s+/)[1],
      'both sandboxes got the same id block',
    );
    await b.destroy('cp-src');
    await b.destroy('cp-dst');
  });

  /**
   * The OOM killer's exemption: any guest process, root of the sandbox or not, started by the init (a daemon from
   * its inittab) or by an exec, tries `echo -1000 > /proc/self/oom_score_adj`; guest root tries it on pid 1 too.
   * The kernel allows a value down to the process's floor (oom_score_adj_min), which forks inherit and only a
   * writer with CAP_SYS_RESOURCE on the host sets: a floor of -1000 inherited from the host side would let the
   * guest exempt itself. Lines: "<label> self <value>", "<label> root|nobody refused|IMMUNE", "pid1 ...".
   */
  async function oomAttempts(backend: ProcessBackend, name: string): Promise<string> {
    const attempt = `#!/bin/sh
echo "$1 self $(cat /proc/self/oom_score_adj)"
if echo -1000 2>/dev/null > /proc/self/oom_score_adj; then echo "$1 root IMMUNE"; else echo "$1 root refused"; fi
su -s /bin/sh nobody -c "echo $1 nobody-uid \\$(id -u); if echo -1000 2>/dev/null > /proc/self/oom_score_adj; then echo $1 nobody IMMUNE; else echo $1 nobody refused; fi"
`;
    await backend.writeGuestFile(name, '/oom-attempt', Readable.from([Buffer.from(attempt)]), { mode: 0o755 });
    // A daemon of the init: busybox init starts a new respawn entry of its inittab on SIGHUP.
    const daemon = '#!/bin/sh\n/oom-attempt init > /oom-init.out 2>&1\nexec sleep 3600\n';
    await backend.writeGuestFile(name, '/oom-daemon', Readable.from([Buffer.from(daemon)]), { mode: 0o755 });
    const r = await sh(
      backend,
      name,
      `echo '::respawn:/oom-daemon' >> /etc/inittab && kill -HUP 1
for i in $(seq 100); do grep -q 'init nobody ' /oom-init.out 2>/dev/null && break; sleep 0.1; done
cat /oom-init.out
/oom-attempt exec
if echo -1000 2>/dev/null > /proc/1/oom_score_adj; then echo "pid1 IMMUNE"; else echo "pid1 refused"; fi`,
    );
    assert.equal(r.exitCode, 0, r.stderr);
    return r.stdout;
  }

  function assertNoImmunity(out: string): void {
    for (const label of ['init', 'exec']) {
      const self = new RegExp(`^${label} self (-?\\d+)$`, 'm').exec(out);
      assert.ok(self, `no reading of ${label}'s oom_score_adj in:\n${out}`);
      assert.ok(Number(self[1]) >= 0, `${label} starts with oom_score_adj ${self[1]}`);
      assert.match(out, new RegExp(`^${label} nobody-uid 65534$`, 'm'), 'the attempt ran as the guest non-root user');
      for (const who of ['root', 'nobody']) assert.match(out, new RegExp(`^${label} ${who} refused$`, 'm'), `${label} as ${who}:\n${out}`);
    }
    assert.match(out, /^pid1 refused$/m, 'guest root set -1000 on the init');
  }

  test('OOM killer: no guest process (init daemon or exec, root or not) can exempt itself; the reaper outside stays exempt', async (t) => {
    await b.create({ name: 'oom', cpus: 1, ram_mb: 64, tenant: 'acme' });
    assertNoImmunity(await oomAttempts(b, 'oom'));
    if (noSysResource) {
      t.diagnostic(`reaper's -1000 not checked: ${noSysResource}`);
      await b.destroy('oom');
      return;
    }
    // The init's parent, the helper's reaper (outside the guest's pid namespace), is still kept from the OOM killer.
    const initPid = (await b.get('oom')).init_pid;
    const stat = await readFile(`/proc/${initPid}/stat`, 'utf8');
    const reaper = Number(stat.slice(stat.lastIndexOf(') ') + 2).split(' ')[1]);
    assert.equal((await readFile(`/proc/${reaper}/oom_score_adj`, 'utf8')).trim(), '-1000');
    await b.destroy('oom');
  });

  test(
    'an agent running with a negative oom_score_adj passes no negative floor to a start or an exec',
    { skip: noSysResource ?? false },
    async () => {
      const own = (await readFile('/proc/self/oom_score_adj', 'utf8')).trim();
      // As host root (CAP_SYS_RESOURCE) this sets the floor too: what a unit with OOMScoreAdjust=-900 gives the agent.
      await writeFile('/proc/self/oom_score_adj', '-900');
      let nb: ProcessBackend;
      try {
        nb = await openBackend(); // its exec spawner forks every exec from a -900 process
        await nb.create({ name: 'oom-neg', cpus: 1, ram_mb: 64, tenant: 'acme' });
      } finally {
        await writeFile('/proc/self/oom_score_adj', own);
      }
      assertNoImmunity(await oomAttempts(nb, 'oom-neg'));
      await nb.destroy('oom-neg');
      await nb.close();
    },
  );

  test('an uploaded file is owned by root inside the sandbox', async () => {
    await b.create({ name: 'own', cpus: 1, ram_mb: 64, tenant: 'acme' });
    await b.writeGuestFile('own', '/root/up.txt', Readable.from([Buffer.from('hello')]));
    const r = await sh(b, 'own', 'stat -c "%u:%g %a" /root/up.txt; cat /root/up.txt');
    assert.equal(r.stdout, '0:0 644\nhello');
    await b.destroy('own');
  });
});
