import assert from 'node:assert/strict';
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { Cgroups } from '../../packages/agent/src/backend/process/cgroups.js';
import { processStartTime } from '../../packages/agent/src/backend/process/exec-util.js';
import { SandboxMonitor, type MonitorTarget } from '../../packages/agent/src/backend/process/monitor.js';

/**
 * The OOM monitor's bookkeeping against a cgroup tree of plain files (a
 * cgroup v2 layout in a temp dir: the monitor only reads memory.events and
 * cgroup.procs) and this test's own process as the "init": the orderings
 * of polls, kills and exec reports that a loaded machine produces, each
 * forced here instead of waited for.
 */
describe('sandbox OOM monitor: polls, kills and exec reports in every order', () => {
  let root: string;
  let target: MonitorTarget;

  before(async () => {
    root = await mkdtemp(join(tmpdir(), 'oom-monitor-'));
    await writeFile(join(root, 'cgroup.controllers'), 'memory\n');
    const start = await processStartTime(process.pid);
    assert.ok(start);
    target = {
      name: 'sb',
      initPid: process.pid,
      initStart: start,
      veth: 'none',
      ramMb: 128,
      sandboxDir: join(root, 'sandbox'),
      storageGb: 1,
    };
  });

  after(async () => {
    await rm(root, { recursive: true, force: true });
  });

  async function monitorWithCount(count: number): Promise<{ monitor: SandboxMonitor; setCount: (n: number) => Promise<void> }> {
    const dir = join(root, 'fleet', target.name);
    await mkdir(dir, { recursive: true });
    await writeFile(join(dir, 'cgroup.procs'), '');
    const setCount = (n: number) => writeFile(join(dir, 'memory.events'), `low 0\nhigh 0\nmax ${n}\noom ${n}\noom_kill ${n}\n`);
    await setCount(count);
    const monitor = new SandboxMonitor({
      cgroups: Cgroups.detect('fleet', root),
      intervalMs: 60_000,
      window: 10,
      oomPollMs: 60_000,
      logsDir: join(root, 'logs'),
      logRetentionMs: 60_000,
      targets: () => [target],
      sandboxDirOf: () => target.sandboxDir,
    });
    return { monitor, setCount };
  }

  it("a first poll between an exec's OOM kill and its report still names the kill after the exec", async () => {
    const { monitor, setCount } = await monitorWithCount(0);
    // The exec's OOM watch reads the counter before the command runs (no poll of this sandbox yet).
    assert.equal(await monitor.oomKills('sb'), 0);
    await setCount(1); // the kernel kills the command
    await monitor.pollOom(); // the monitor's first poll of the sandbox, before the exec has reported
    monitor.noteKilledExec('sb', '/bin/dd'); // the exec reports its SIGKILL as an OOM kill
    await monitor.pollOom();
    const report = monitor.oom('sb');
    assert.ok(report);
    assert.equal(report.kills, 1);
    assert.deepEqual(
      report.events.map((e) => e.process),
      ['dd'],
    );
  });

  it('kills counted before the monitor first saw the sandbox (an agent restart) are counted, not named', async () => {
    const { monitor, setCount } = await monitorWithCount(2);
    await monitor.pollOom();
    await monitor.pollOom();
    assert.deepEqual(monitor.oom('sb')?.events, []);
    await setCount(3);
    await monitor.pollOom();
    await monitor.pollOom();
    const report = monitor.oom('sb');
    assert.equal(report?.kills, 3);
    assert.deepEqual(
      report.events.map((e) => [e.count, e.process]),
      [[3, 'unknown']],
    );
  });
});
