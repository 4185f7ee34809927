import { existsSync } from 'node:fs';
import { mkdir, readdir, readFile, rmdir, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { featureMissing } from '../../backend.js';
import { sleep } from './exec-util.js';

/**
 * CPU, memory and pid limits through cgroups, v1 (what these hosts mount:
 * one hierarchy per controller) or v2 (one unified hierarchy). Every sandbox
 * gets `<parent>/<name>` where parent is `fleet-<bridgePrefix>`, so two
 * agents on one host never touch each other's groups, and prune can tell
 * ours from everyone else's. The freezer makes a checkpoint consistent.
 */

export interface CgroupLimits {
  readonly cpus: number;
  readonly ramMb: number;
  readonly pidsMax: number;
}

const V1_CONTROLLERS = ['cpu', 'memory', 'pids', 'freezer'] as const;
const CFS_PERIOD = 100_000;

export class Cgroups {
  private constructor(
    readonly version: 1 | 2,
    private readonly root: string,
    readonly parent: string,
  ) {}

  static detect(parent: string, root = '/sys/fs/cgroup'): Cgroups {
    if (existsSync(join(root, 'cgroup.controllers'))) return new Cgroups(2, root, parent);
    const missing = V1_CONTROLLERS.filter((c) => !existsSync(join(root, c, 'tasks')));
    if (missing.length === 0) return new Cgroups(1, root, parent);
    throw featureMissing(
      `cgroups (${missing.join(', ')} controller${missing.length > 1 ? 's' : ''} not mounted)`,
      `mount cgroup v1 controllers under ${root}/<controller> or cgroup v2 at ${root}`,
    );
  }

  /** Directories of one sandbox's group, one per hierarchy. */
  dirs(name: string): string[] {
    return this.version === 2
      ? [join(this.root, this.parent, name)]
      : this.v1Controllers().map((c) => join(this.root, c, this.parent, name));
  }

  /**
   * v1 hierarchies joined: the four the limits need, then cpuacct where it is mounted apart from cpu (CPU time for
   * the metrics; v2's cpu.stat has it). Appended last: callers index the first four.
   */
  private v1Controllers(): string[] {
    return existsSync(join(this.root, 'cpuacct', 'cpuacct.usage')) ? [...V1_CONTROLLERS, 'cpuacct'] : [...V1_CONTROLLERS];
  }

  /** The directory holding `controller`'s files for a sandbox (v2: the one group); undefined where it is not mounted. */
  controllerDir(name: string, controller: 'cpu' | 'cpuacct' | 'memory' | 'pids'): string | undefined {
    if (this.version === 2) return join(this.root, this.parent, name);
    return this.v1Controllers().includes(controller) ? join(this.root, controller, this.parent, name) : undefined;
  }

  /** One directory per v1 controller, by name. */
  private v1(name: string): Record<(typeof V1_CONTROLLERS)[number], string> {
    const dir = (c: string): string => join(this.root, c, this.parent, name);
    return { cpu: dir('cpu'), memory: dir('memory'), pids: dir('pids'), freezer: dir('freezer') };
  }

  /** The group that freezes the sandbox (CRIU's --freeze-cgroup). */
  freezerDir(name: string): string {
    return this.version === 2 ? join(this.root, this.parent, name) : join(this.root, 'freezer', this.parent, name);
  }

  /** The files a process writes its pid to, to join the group (all of them, in order). */
  procsFiles(name: string): string[] {
    // cpuacct only where it exists: a sandbox created before it was joined has none, and joining a missing group fails.
    return this.dirs(name)
      .filter((d, i) => i < V1_CONTROLLERS.length || existsSync(d))
      .map((d) => join(d, 'cgroup.procs'));
  }

  async create(name: string, limits: CgroupLimits): Promise<void> {
    const quota = String(Math.max(1000, Math.round(limits.cpus * CFS_PERIOD)));
    const mem = String(limits.ramMb * 1024 * 1024);
    const pids = String(limits.pidsMax);
    if (this.version === 2) {
      await this.enableV2Controllers();
      const dir = join(this.root, this.parent, name);
      await mkdir(dir, { recursive: true });
      await writeFile(join(dir, 'cpu.max'), `${quota} ${CFS_PERIOD}`);
      await writeFile(join(dir, 'memory.max'), mem);
      await writeFile(join(dir, 'memory.swap.max'), '0').catch(() => undefined);
      await writeFile(join(dir, 'pids.max'), pids);
      return;
    }
    for (const dir of this.dirs(name)) await mkdir(dir, { recursive: true });
    const { cpu, memory, pids: pidsDir } = this.v1(name);
    await writeFile(join(cpu, 'cpu.cfs_period_us'), String(CFS_PERIOD));
    await writeFile(join(cpu, 'cpu.cfs_quota_us'), quota);
    await writeFile(join(memory, 'memory.limit_in_bytes'), mem);
    await writeFile(join(pidsDir, 'pids.max'), pids);
  }

  /** HOST_FEATURE_MISSING unless the controllers the limits need are there (checked at open, not at the first create). */
  async verify(): Promise<void> {
    if (this.version === 1) return;
    const available = (await readFile(join(this.root, 'cgroup.controllers'), 'utf8').catch(() => '')).split(/\s+/);
    const missing = ['cpu', 'memory', 'pids'].filter((c) => !available.includes(c));
    if (missing.length > 0)
      throw featureMissing(
        `cgroup v2 controller${missing.length > 1 ? 's' : ''} ${missing.join(', ')}`,
        `enable them in ${this.root}/cgroup.controllers (they may be bound to a v1 hierarchy)`,
      );
  }

  private async enableV2Controllers(): Promise<void> {
    const parentDir = join(this.root, this.parent);
    await mkdir(parentDir, { recursive: true });
    await this.verify();
    for (const dir of [this.root, parentDir]) {
      const enabled = await readFile(join(dir, 'cgroup.subtree_control'), 'utf8').catch(() => '');
      for (const c of ['cpu', 'memory', 'pids']) {
        if (!enabled.split(/\s+/).includes(c)) await writeFile(join(dir, 'cgroup.subtree_control'), `+${c}`);
      }
    }
  }

  /** The limit files as the kernel reports them, for tests and diagnostics. */
  async readLimits(name: string): Promise<{ cpuQuotaUs: number; cpuPeriodUs: number; memoryBytes: number; pidsMax: number }> {
    if (this.version === 2) {
      const dir = join(this.root, this.parent, name);
      const [q, p] = (await readFile(join(dir, 'cpu.max'), 'utf8')).trim().split(' ');
      return {
        cpuQuotaUs: Number(q),
        cpuPeriodUs: Number(p),
        memoryBytes: Number((await readFile(join(dir, 'memory.max'), 'utf8')).trim()),
        pidsMax: Number((await readFile(join(dir, 'pids.max'), 'utf8')).trim()),
      };
    }
    const { cpu, memory, pids } = this.v1(name);
    const num = async (f: string): Promise<number> => Number((await readFile(f, 'utf8')).trim());
    return {
      cpuQuotaUs: await num(join(cpu, 'cpu.cfs_quota_us')),
      cpuPeriodUs: await num(join(cpu, 'cpu.cfs_period_us')),
      memoryBytes: await num(join(memory, 'memory.limit_in_bytes')),
      pidsMax: await num(join(pids, 'pids.max')),
    };
  }

  async pids(name: string): Promise<number[]> {
    const out = new Set<number>();
    for (const f of this.procsFiles(name)) {
      const text = await readFile(f, 'utf8').catch(() => '');
      for (const line of text.split('\n')) if (line.trim()) out.add(Number(line));
    }
    return [...out];
  }

  async setFrozen(name: string, frozen: boolean): Promise<void> {
    if (this.version === 2) {
      const dir = join(this.root, this.parent, name);
      await writeFile(join(dir, 'cgroup.freeze'), frozen ? '1' : '0');
      for (let i = 0; i < 500; i++) {
        const events = await readFile(join(dir, 'cgroup.events'), 'utf8');
        if (events.includes(`frozen ${frozen ? 1 : 0}`)) return;
        await sleep(10);
      }
      throw new Error(`cgroup ${name} did not ${frozen ? 'freeze' : 'thaw'} within 5s`);
    }
    const dir = this.v1(name).freezer;
    await writeFile(join(dir, 'freezer.state'), frozen ? 'FROZEN' : 'THAWED');
    for (let i = 0; i < 500; i++) {
      const state = (await readFile(join(dir, 'freezer.state'), 'utf8')).trim();
      if (state === (frozen ? 'FROZEN' : 'THAWED')) return;
      await sleep(10);
    }
    throw new Error(`cgroup ${name} did not ${frozen ? 'freeze' : 'thaw'} within 5s`);
  }

  /** Kills every member and waits (at most ~2 s) for the group to empty. Returns the pids it killed. */
  async killAll(name: string): Promise<number[]> {
    const killed: number[] = [];
    // A frozen group cannot die: thaw first (a crash mid-checkpoint leaves it frozen).
    await this.setFrozen(name, false).catch(() => undefined);
    for (let i = 0; i < 200; i++) {
      const pids = await this.pids(name);
      if (pids.length === 0) break;
      for (const pid of pids) {
        try {
          process.kill(pid, 'SIGKILL');
          if (!killed.includes(pid)) killed.push(pid);
        } catch {
          /* already gone */
        }
      }
      await sleep(10);
    }
    return killed;
  }

  /** Kills every member, waits for the group to empty, removes it. Returns the pids it killed. */
  async remove(name: string): Promise<number[]> {
    const dirs = this.dirs(name).filter((d) => existsSync(d));
    if (dirs.length === 0) return [];
    const killed = await this.killAll(name);
    for (const dir of dirs) {
      for (let i = 0; i < 50; i++) {
        try {
          await rmdir(dir);
          break;
        } catch (err) {
          if ((err as NodeJS.ErrnoException).code === 'ENOENT') break;
          if (i === 49) throw err;
          await sleep(20);
        }
      }
    }
    return killed;
  }

  /** Removes our parent group(s) if nothing is left under them; create() makes them again. */
  async removeParentIfEmpty(): Promise<boolean> {
    const parents = this.version === 2 ? [join(this.root, this.parent)] : this.v1Controllers().map((c) => join(this.root, c, this.parent));
    let removed = false;
    for (const p of parents) {
      try {
        await rmdir(p);
        removed = true;
      } catch {
        /* absent, or still has children */
      }
    }
    return removed;
  }

  /** Names of the sandbox groups under our parent, across hierarchies. */
  async list(): Promise<string[]> {
    const parents = this.version === 2 ? [join(this.root, this.parent)] : this.v1Controllers().map((c) => join(this.root, c, this.parent));
    const names = new Set<string>();
    for (const p of parents) {
      const entries = await readdir(p, { withFileTypes: true }).catch(() => []);
      for (const e of entries) if (e.isDirectory()) names.add(e.name);
    }
    return [...names];
  }
}
