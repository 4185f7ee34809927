import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { mkdtemp, readdir, readFile, realpath, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { AppError } from '@fleet/agent-protocol';
import { ProcessBackend, type ProcessBackendOptions } from '../../packages/agent/src/backend/process/process-backend.js';
import { rewriteUsernsImage } from '../../packages/agent/src/backend/process/criu.js';
import { layerDirs } from '../../packages/agent/src/backend/process/storage.js';
import { buildImage } from '../../packages/agent/src/images.js';
import { collect, type Ran } from '../support/process.js';
import { MEMORY_HOLDER, memoryHolder, slowPagesCriu, throttledCgroup } from './harness.js';

/**
 * Memory checkpoints of real sandboxes with CRIU: found through CRIU_PATH
 * (CI exports the binary scripts/criu/build.sh prints). Without one the
 * sandbox tests skip, except under CI=true, where a missing CRIU fails.
 */

function missing(): string | undefined {
  if (process.platform !== 'linux' || process.getuid?.() !== 0) return 'Linux and root';
  if (!existsSync('/bin/busybox')) return 'busybox-static';
  const criu = process.env.CRIU_PATH;
  if (!criu || !existsSync(criu)) return 'CRIU (set CRIU_PATH to the binary scripts/criu/build.sh prints)';
  if (spawnSync(criu, ['check']).status !== 0) return `a working CRIU (${criu} check fails)`;
  return undefined;
}

const skip = missing();
if (skip && process.env.CI === 'true') {
  test('CRIU is available in CI', () => assert.fail(`missing: ${skip}`));
}

const uniquePrefix = (): string => `c${randomBytes(2).toString('hex')}`;
const uniqueSubnet = (): string => `10.${245 + (randomBytes(1)[0]! % 5)}.${randomBytes(1)[0]!}.0/24`;

async function sh(b: ProcessBackend, name: string, script: string): Promise<Ran> {
  return collect(await b.spawn(name, { argv: ['/bin/sh', '-c', script], stdin: false }));
}

async function count(b: ProcessBackend, name: string): Promise<number> {
  const r = await sh(b, name, 'cat /tmp/count');
  assert.equal(r.exitCode, 0, r.stderr);
  return Number(r.stdout.trim());
}

/** The startup script of the issue: a counter, and a server on 8080 that answers with the count. */
const STARTUP =
  'echo 0 > /tmp/count; (i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done) >/dev/null 2>&1 & ' +
  '(while true; do echo -e "HTTP/1.0 200 OK\\r\\n\\r\\ncount $(cat /tmp/count)" | nc -l -p 8080; done) >/dev/null 2>&1 & echo started';

async function answer(url: string): Promise<string> {
  for (let i = 0; ; i++) {
    try {
      return await fetch(url, { signal: AbortSignal.timeout(3000) }).then((r) => r.text());
    } catch (err) {
      if (i >= 20) throw err;
      await new Promise((r) => setTimeout(r, 100));
    }
  }
}

async function rejectsWithCode(p: Promise<unknown>, code: string): Promise<void> {
  await assert.rejects(p, (err: unknown) => {
    assert.ok(err instanceof AppError, `expected an AppError, got ${String(err)}`);
    assert.equal(err.code, code, err.message);
    return true;
  });
}

describe('criu: pure parts', () => {
  test('a userns image moves to another id block, extent by extent, and refuses a map that is not the sandbox', () => {
    // 8 bytes of magic, then u32 length + userns_entry{uid_map{0, 0x5f420000, 65536}, gid_map{same}}, as criu 4.1.1 wrote it.
    const img = Buffer.from(
      '1943565406494755' + '1c000000' + '0a0c0800108080' + '88fa05' + '1880800412' + '0c0800108080' + '88fa05' + '18808004',
      'hex',
    );
    const moved = rewriteUsernsImage(img, 0x5f420000, 0x77360000);
    assert.equal(moved.subarray(0, 8).toString('hex'), '1943565406494755');
    const again = rewriteUsernsImage(moved, 0x77360000, 0x5f420000);
    assert.deepEqual(again, img, 'the rewrite is exact both ways');
    assert.ok(!moved.equals(img));
    assert.throws(() => rewriteUsernsImage(img, 0x10000, 0x20000), /not the sandbox/);
  });
});

describe('criu: memory checkpoints of real sandboxes', { skip: skip ? `missing: ${skip}` : false, timeout: 600_000 }, () => {
  let root: string;
  let imageDir: string;
  const backends: ProcessBackend[] = [];
  const prefixes: string[] = [];
  let b: ProcessBackend;

  async function openBackend(env?: string, extra: Partial<ProcessBackendOptions> = {}): Promise<ProcessBackend> {
    const bridgePrefix = uniquePrefix();
    prefixes.push(bridgePrefix);
    const options: ProcessBackendOptions = {
      dataDir: await mkdtemp(join(root, 'data-')),
      imageDir,
      subnet: uniqueSubnet(),
      bridgePrefix,
      ...extra,
    };
    const saved = process.env.CRIU_PATH;
    if (env !== undefined) process.env.CRIU_PATH = env;
    try {
      const backend = await ProcessBackend.open(options);
      backends.push(backend);
      return backend;
    } finally {
      process.env.CRIU_PATH = saved;
    }
  }

  before(async () => {
    root = await mkdtemp(join(tmpdir(), 'criu-test-'));
    imageDir = join(root, 'images');
    await buildImage(imageDir, 'base');
    b = await openBackend();
  });

  after(async () => {
    for (const backend of backends) {
      for (const s of await backend.list().catch(() => [])) await backend.destroy(s.name).catch(() => undefined);
      await backend.prune().catch(() => undefined);
      await backend.close().catch(() => undefined);
    }
    const links = spawnSync('ip', ['-j', 'link', 'show'], { encoding: 'utf8' }).stdout;
    for (const l of (JSON.parse(links || '[]') as Array<{ ifname: string }>).map((x) => x.ifname.split('@')[0]!)) {
      if (prefixes.some((p) => l.startsWith(p))) spawnSync('ip', ['link', 'del', l]);
    }
    for (const p of prefixes) for (const family of ['inet', 'bridge']) spawnSync('nft', ['delete', 'table', family, `fleet_${p}`]);
    await rm(root, { recursive: true, force: true });
  });

  async function counterSandbox(name: string): Promise<string> {
    const info = await b.create({ name, cpus: 1, ram_mb: 256, storage_gb: 1, tenant: 't1', expose: [{ port: 8080, as: 'http' }] });
    const r = await sh(b, name, STARTUP);
    assert.equal(r.stdout.trim(), 'started', r.stderr);
    for (let i = 0; i < 100 && (await sh(b, name, 'test -s /tmp/count')).exitCode !== 0; i++) await new Promise((r) => setTimeout(r, 20));
    return info.endpoints[0]!.url;
  }

  test('capacity says what this host can do', async () => {
    const cap = await b.capacity();
    assert.equal(cap.live_snapshot, true);
    assert.equal(typeof cap.lazy_pages, 'boolean');
    assert.equal(cap.memory_diff, false, 'this kernel has no soft-dirty bits');
  });

  test('a counter keeps counting across ten pauses and resumes; the server answers through its endpoint after each', async () => {
    const url = await counterSandbox('pr');
    let last = await count(b, 'pr');
    for (let i = 0; i < 10; i++) {
      const cp = await b.pause('pr');
      assert.equal(cp.kind, 'live');
      assert.equal((await b.get('pr')).state, 'paused');
      assert.deepEqual((await b.get('pr')).endpoints, []);
      await rejectsWithCode(b.spawn('pr', { argv: ['true'], stdin: false }), 'SANDBOX_NOT_FOUND');
      const again = await b.pause('pr');
      assert.equal(again.id, cp.id, 'a second pause answers the first');
      // A host firewall reload while it is paused: the resume (whose own rules are unchanged) has the tables put back.
      if (i === 1) spawnSync('nft', ['delete', 'table', 'bridge', `fleet_${prefixes[0]}`]);
      if (i === 0) {
        // The masked directories are binds of the agent's empty directory, which CRIU leaves out: /dev is the one
        // tmpfs it archives (a tmpfs mask would add a tar and a gzip to every dump and restore).
        const tmpfs = (await readdir(await b.checkpointDir(cp.id))).filter((f) => /tmpfs/.test(f));
        assert.equal(tmpfs.length, 1, `tmpfs images: ${tmpfs.join(', ')}`);
      }
      const info = await b.resume('pr');
      assert.equal(info.state, 'running');
      assert.equal(info.endpoints[0]!.url, url, 'the endpoint is republished on its port');
      const now = await count(b, 'pr');
      assert.ok(now >= last, `counter went back: ${now} < ${last}`);
      assert.ok(now < last + 200, `counter restarted or jumped: ${last} -> ${now}`);
      assert.match(await answer(url), /^count \d+/);
      if (i === 1) {
        const { veth } = JSON.parse(await readFile(join(b.sandboxDir('pr'), 'state.json'), 'utf8')) as { veth: string };
        let chain = '';
        for (let k = 0; k < 100 && !chain.includes(`ether saddr != ${info.mac} drop`); k++) {
          await new Promise((r) => setTimeout(r, 30));
          chain = spawnSync('nft', ['list', 'chain', 'bridge', `fleet_${prefixes[0]}`, `port_${veth}`], { encoding: 'utf8' }).stdout;
        }
        assert.match(chain, new RegExp(`ether saddr != ${info.mac} drop`), 'the deleted table is back after the resume');
      }
      if (i === 0) {
        // Its layer-2 rules stayed through the pause (the resume applies no new ruleset when nothing changed): only its
        // own MAC and address may leave its port.
        const { veth } = JSON.parse(await readFile(join(b.sandboxDir('pr'), 'state.json'), 'utf8')) as { veth: string };
        const chain = spawnSync('nft', ['list', 'chain', 'bridge', `fleet_${prefixes[0]}`, `port_${veth}`], { encoding: 'utf8' });
        assert.match(
          chain.stdout,
          new RegExp(`ether saddr != ${info.mac} drop[\\s\\S]*ip saddr != ${info.ip.replaceAll('.', '\\.')} drop`),
        );
        // The /proc masks come back as binds of /dev/null, never of the host's own /proc files.
        const masks = await sh(b, 'pr', "grep -E ' /proc/(keys|timer_list) ' /proc/self/mountinfo");
        assert.match(masks.stdout, /\/proc\/keys .* - devtmpfs /);
        assert.doesNotMatch(masks.stdout, / - proc /);
        // And the masked directories as the same empty, read-only directory.
        const dirs = await sh(
          b,
          'pr',
          'for d in /proc/acpi /sys/firmware; do [ -d $d ] || continue; echo "$d $(ls -A $d | wc -l)"; mkdir $d/x 2>/dev/null && echo "$d WRITABLE"; done; grep " /sys/firmware " /proc/self/mountinfo',
        );
        if (existsSync('/sys/firmware')) {
          assert.match(dirs.stdout, /^\/sys\/firmware 0$/m, dirs.stdout);
          assert.match(dirs.stdout, / \/sys\/firmware ro,nosuid,nodev,noexec/, dirs.stdout);
        }
        assert.doesNotMatch(dirs.stdout, /WRITABLE|^\/\S+ [1-9]/m, dirs.stdout);
      }
      last = now;
      await new Promise((r) => setTimeout(r, 100));
      assert.ok((await count(b, 'pr')) > now, 'and counts on');
    }
    assert.deepEqual(
      (await b.listCheckpoints()).filter((c) => c.comment === 'pause'),
      [],
      'each resume removes its pause checkpoint',
    );
  });

  test('a resume runs before its memory is in (paged in from the local images); a pause meanwhile waits for every page', async (t) => {
    if (!(await b.capacity()).lazy_pages) return t.skip('this host cannot restore lazily');
    // Fault injection: CRIU through a wrapper that puts the lazy-pages daemon (the one reading the images into the
    // restored memory) in a cgroup held to 2% of a CPU while /slow exists, so the pause below comes while pages are
    // still missing. CRIU dumps the pages present: without the wait, the missing ones would come back zero.
    const cg = throttledCgroup();
    if (!cg) return t.skip('no cpu cgroup controller to slow the daemon with');
    t.after(() => cg.remove());
    const slow = join(root, 'slow');
    const bs = await openBackend(await slowPagesCriu(join(root, 'criu-slow-pages'), process.env.CRIU_PATH!, slow, cg.procs));
    await bs.create({ name: 'lz', cpus: 1, ram_mb: 512, storage_gb: 1, tenant: 't1' });
    assert.equal((await sh(bs, 'lz', MEMORY_HOLDER)).exitCode, 0);
    const holder = memoryHolder((script) => sh(bs, 'lz', script));
    await holder.ready();
    const before = await holder.sum();
    assert.match(before, / 67108864$/, 'the holder wrote its 64 MiB');
    await bs.pause('lz');
    await writeFile(slow, '');
    try {
      await bs.resume('lz');
    } finally {
      await rm(slow);
    }
    cg.tighten();
    // Running before its pages are in (the daemon logs what it has to page in once each task hands it over).
    let right = await bs.lazy.memoryStatus('lz');
    for (let i = 0; i < 100 && right.total_chunks === 0; i++) {
      await new Promise((r) => setTimeout(r, 50));
      right = await bs.lazy.memoryStatus('lz');
    }
    assert.ok(right.total_chunks > 15_000 && right.resident_chunks < right.total_chunks && !right.done, JSON.stringify(right));
    const paused = bs.pause('lz');
    const waited = await Promise.race([paused.then(() => false), new Promise((r) => setTimeout(() => r(true), 1000))]);
    assert.ok(waited, 'the pause waits while pages are missing');
    cg.unthrottle();
    await paused;
    await bs.resume('lz');
    assert.equal(await holder.sum(), before, 'the memory came back whole');
    for (let i = 0; i < 200 && !(await bs.lazy.memoryStatus('lz')).done; i++) await new Promise((r) => setTimeout(r, 50));
    const done = await bs.lazy.memoryStatus('lz');
    assert.ok(done.done && done.resident_chunks === done.total_chunks && done.error === undefined, JSON.stringify(done));
    await bs.destroy('lz');
  });

  test('with lazyRestore off, a resume reads every page before it answers', async () => {
    const full = await openBackend(undefined, { lazyRestore: false });
    await full.create({ name: 'fr', cpus: 1, ram_mb: 256, storage_gb: 1, tenant: 't1' });
    assert.equal((await sh(full, 'fr', STARTUP)).stdout.trim(), 'started');
    for (let i = 0; i < 100 && (await sh(full, 'fr', 'test -s /tmp/count')).exitCode !== 0; i++)
      await new Promise((r) => setTimeout(r, 20));
    const last = await count(full, 'fr');
    await full.pause('fr');
    await full.resume('fr');
    assert.deepEqual(await full.lazy.memoryStatus('fr'), { resident_chunks: 0, total_chunks: 0, done: true }, 'nothing paged in after');
    assert.ok((await count(full, 'fr')) >= last);
    await full.destroy('fr');
  });

  test('concurrent resumes: one restores, the others see it running', async () => {
    await counterSandbox('cc');
    await Promise.all([b.pause('cc'), b.pause('cc')]);
    const infos = await Promise.all([b.resume('cc'), b.resume('cc'), b.resume('cc')]);
    assert.ok(
      infos.every((i) => i.state === 'running' && i.init_pid === infos[0].init_pid),
      'one restore, one init',
    );
    await count(b, 'cc');
  });

  test('a restore that hangs is killed at its deadline and tried again: the resume succeeds, nothing of the hung try is left', async () => {
    // Fault injection: the backend's CRIU action script is wrapped so that its first setup-namespaces (the restored
    // tree waits on it) hangs; every other call runs the real hook.
    const host = (b as unknown as { host: { criuHook: string; restoreDeadlineMs: number } }).host;
    const real = host.criuHook;
    const marker = join(root, 'hook-hung-once');
    const wrapper = join(root, 'hang-once-hook.sh');
    await writeFile(
      wrapper,
      `#!/bin/sh\nif [ "$CRTOOLS_SCRIPT_ACTION" = setup-namespaces ] && mkdir ${marker} 2>/dev/null; then exec sleep 600; fi\nexec ${real} "$@"\n`,
      { mode: 0o700 },
    );
    const saved = host.restoreDeadlineMs;
    await counterSandbox('hang');
    const before = await count(b, 'hang');
    await b.pause('hang');
    host.criuHook = wrapper;
    host.restoreDeadlineMs = 3_000;
    try {
      const info = await b.resume('hang');
      assert.equal(info.state, 'running');
      assert.ok(existsSync(marker), 'the first try did hang');
      // Its whole criu log is kept for whoever looks into why.
      const hungDir = join((b as unknown as { host: { opts: { dataDir: string } } }).host.opts.dataDir, 'criu-hung');
      const kept = (await readdir(hungDir)).filter((f) => f.endsWith('-hang-try1.log'));
      assert.equal(kept.length, 1, kept.join(', '));
      const keptLog = await readFile(join(hungDir, kept[0]!), 'utf8');
      assert.notEqual(keptLog, '');
      // With its lazy-pages daemon's log, where the restore had one.
      if ((await b.capacity()).lazy_pages) assert.match(keptLog, /\n---- lazy-pages\.log ----\n\S/);
    } finally {
      host.criuHook = real;
      host.restoreDeadlineMs = saved;
    }
    const now = await count(b, 'hang');
    assert.ok(now >= before && now < before + 200, `the counter went on from ${before}: ${now}`);
    // The hung try's criu and its hook's sleep are gone; one init runs in the sandbox.
    const ps = spawnSync('ps', ['-eo', 'args'], { encoding: 'utf8' }).stdout;
    assert.ok(!ps.includes(`sleep 600`), 'the hung hook is gone');
    assert.equal((await sh(b, 'hang', 'ps -o comm | grep -c "^init$"')).stdout.trim(), '1', 'one init in the sandbox');
  });

  test('live snapshot: the sandbox keeps running, memory files carry their sha256; fork ×3 continue from it; restore in place', async () => {
    const url = await counterSandbox('src');
    const before = await count(b, 'src');
    const cp = await b.checkpoint('src', { live: true, comment: 'live' });
    assert.equal(cp.kind, 'live');
    assert.ok(cp.pause_ms !== undefined && cp.pause_ms > 0);
    assert.ok(Object.keys(cp.files).length > 5);
    const dir = await b.checkpointDir(cp.id);
    for (const [file, sha] of Object.entries(cp.files)) {
      assert.equal(
        createHash('sha256')
          .update(await readFile(join(dir, file)))
          .digest('hex'),
        sha,
        file,
      );
    }
    await new Promise((r) => setTimeout(r, 200));
    const after = await count(b, 'src');
    assert.ok(after > before, 'the source never stopped');
    assert.match(await answer(url), /^count /);

    const forks = [];
    for (const n of ['f1', 'f2', 'f3']) {
      forks.push(
        await b.create({
          name: n,
          checkpointId: cp.id,
          resume: true,
          cpus: 1,
          ram_mb: 256,
          storage_gb: 1,
          tenant: 't1',
          expose: [{ port: 8080, as: 'http' }],
        }),
      );
    }
    const ips = new Set([...forks.map((f) => f.ip), (await b.get('src')).ip]);
    const macs = new Set([...forks.map((f) => f.mac), (await b.get('src')).mac]);
    assert.equal(ips.size, 4, 'each fork has its own address');
    assert.equal(macs.size, 4, 'and its own MAC');
    const maps = new Set(
      [...forks, await b.get('src')].map((f) => spawnSync('cat', [`/proc/${f.init_pid}/uid_map`], { encoding: 'utf8' }).stdout.trim()),
    );
    assert.equal(maps.size, 4, 'and its own id block');
    for (const f of forks) {
      assert.equal((await sh(b, f.name, 'hostname')).stdout.trim(), f.name);
      const c = await count(b, f.name);
      assert.ok(c >= before && c < after + 200, `fork ${f.name} continues from the captured value (${before}..${after}), got ${c}`);
      assert.match(await answer(f.endpoints[0]!.url), /^count \d+/);
    }
    // Each fork's network comes from the helper as CRIU's action script: eth0 with the fork's MAC and address, its
    // default route and ping range (group ids of the sandbox's own); on the host, its veth a port of the tenant's
    // bridge with IPv6 off and router advertisements refused, and a /32 route to it from the gateway. The root CRIU
    // restored from is no longer mounted in the agent's namespace.
    const agentMounts = await readFile('/proc/self/mountinfo', 'utf8');
    for (const f of forks) {
      const state = JSON.parse(await readFile(join(b.sandboxDir(f.name), 'state.json'), 'utf8')) as { veth: string; bridge: string };
      const inside = await sh(
        b,
        f.name,
        'cat /sys/class/net/eth0/address; ip -4 addr show eth0; ip route; cat /proc/sys/net/ipv4/ping_group_range',
      );
      assert.equal(inside.stdout.split('\n')[0], f.mac, inside.stdout);
      assert.match(inside.stdout, new RegExp(`inet ${f.ip.replaceAll('.', '\\.')}/\\d+ `), inside.stdout);
      const gw = /^default via (\S+) dev eth0/m.exec(inside.stdout)?.[1];
      assert.ok(gw, inside.stdout);
      assert.match(inside.stdout, /^0\s+65535$/m, 'ping needs no CAP_NET_RAW in the fork either');
      const routes = JSON.parse(spawnSync('ip', ['-j', 'route', 'show', 'dev', state.bridge], { encoding: 'utf8' }).stdout) as Array<{
        dst: string;
        prefsrc?: string;
      }>;
      assert.ok(
        routes.some((r) => r.dst === f.ip && r.prefsrc === gw),
        JSON.stringify(routes),
      );
      assert.equal(basename(await realpath(`/sys/class/net/${state.veth}/master`)), state.bridge);
      assert.equal((await readFile(`/sys/class/net/${state.veth}/operstate`, 'utf8')).trim(), 'up');
      for (const [sysctl, want] of [
        ['disable_ipv6', '1'],
        ['accept_ra', '0'],
      ])
        assert.equal((await readFile(`/proc/sys/net/ipv6/conf/${state.veth}/${sysctl}`, 'utf8')).trim(), want, sysctl);
      assert.ok(!agentMounts.includes(` ${join(b.sandboxDir(f.name), 'root')} `), 'the restore root was detached');
    }
    // Independent: one fork's file is not another's.
    await sh(b, 'f1', 'echo mine > /root/f1');
    assert.notEqual((await sh(b, 'f2', 'cat /root/f1')).exitCode, 0);
    // The restored root is idmapped to the fork's own id block (the helper's mount-root 0): the image and the fork's
    // new files are root's inside, and its layer records plain 0 on disk, never a host id.
    assert.equal((await sh(b, 'f1', 'stat -c %u:%g /root/f1 /bin/busybox')).stdout, '0:0\n0:0\n');
    const onDisk = spawnSync('stat', ['-c', '%u:%g', join(layerDirs(b.sandboxDir('f1'), 1).upper, 'root', 'f1')], { encoding: 'utf8' });
    assert.equal(onDisk.stdout.trim(), '0:0', onDisk.stderr);

    await sh(b, 'src', 'echo later > /root/after-snapshot');
    const back = await b.restoreCheckpoint('src', cp.id);
    assert.equal(back.state, 'running');
    assert.notEqual((await sh(b, 'src', 'cat /root/after-snapshot')).exitCode, 0, 'the layer is the snapshot, not what came after');
    const c = await count(b, 'src');
    assert.ok(c < after + 200, `restored counter starts from the snapshot, got ${c}`);
    assert.match(await answer(url), /^count /);
    for (const n of ['f1', 'f2', 'f3']) await b.destroy(n);
  });

  test('a host without CRIU: pause is refused with a stable code, a live request is filed as disk', async () => {
    const plain = await openBackend('/nonexistent/criu');
    assert.equal((await plain.capacity()).live_snapshot, false);
    await plain.create({ name: 'plain', cpus: 1, ram_mb: 128, tenant: 't1' });
    await rejectsWithCode(plain.pause('plain'), 'MEMORY_CHECKPOINT_UNSUPPORTED');
    const cp = await plain.checkpoint('plain', { live: true });
    assert.equal(cp.kind, 'disk');
    assert.deepEqual(cp.files, {});
    await rejectsWithCode(
      plain.create({ name: 'plain2', checkpointId: cp.id, resume: true, cpus: 1, ram_mb: 128, tenant: 't1' }),
      'MEMORY_CHECKPOINT_UNSUPPORTED',
    );
    await plain.destroy('plain');
  });

  test('a disk checkpoint cannot be resumed, only booted', async () => {
    await b.create({ name: 'dk', cpus: 1, ram_mb: 128, tenant: 't1' });
    const cp = await b.checkpoint('dk', {});
    assert.equal(cp.kind, 'disk');
    await rejectsWithCode(
      b.create({ name: 'dk2', checkpointId: cp.id, resume: true, cpus: 1, ram_mb: 128, tenant: 't1' }),
      'CHECKPOINT_NOT_LIVE',
    );
    await b.destroy('dk');
  });

  test('a guest left frozen by an agent that died mid-checkpoint is thawed when the agent comes back', async () => {
    const prefix = uniquePrefix();
    prefixes.push(prefix);
    const options: ProcessBackendOptions = {
      dataDir: await mkdtemp(join(root, 'data-')),
      imageDir,
      subnet: uniqueSubnet(),
      bridgePrefix: prefix,
    };
    const first = await ProcessBackend.open(options);
    backends.push(first);
    await first.create({ name: 'fz', cpus: 1, ram_mb: 128, tenant: 't1' });
    await sh(first, 'fz', STARTUP);
    await new Promise((r) => setTimeout(r, 300));
    const v2 = existsSync('/sys/fs/cgroup/cgroup.controllers');
    const { writeFile } = await import('node:fs/promises');
    if (v2) await writeFile(`/sys/fs/cgroup/fleet-${prefix}/fz/cgroup.freeze`, '1');
    else await writeFile(`/sys/fs/cgroup/freezer/fleet-${prefix}/fz/freezer.state`, 'FROZEN');
    await first.close();
    const again = await ProcessBackend.open(options);
    backends.push(again);
    const c1 = await count(again, 'fz');
    await new Promise((r) => setTimeout(r, 300));
    assert.ok((await count(again, 'fz')) > c1, 'the counter runs again');
    await again.destroy('fz');
  });

  test('a paused sandbox is destroyed with its pause checkpoint, leaving nothing', async () => {
    await counterSandbox('gone');
    const cp = await b.pause('gone');
    await b.destroy('gone');
    await rejectsWithCode(b.getCheckpoint(cp.id), 'CHECKPOINT_NOT_FOUND');
    await rejectsWithCode(b.get('gone'), 'SANDBOX_NOT_FOUND');
  });
});
