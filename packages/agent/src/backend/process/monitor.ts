import { existsSync } from 'node:fs';
import { link, mkdir, readdir, readFile, rename, rm, stat, writeFile } from 'node:fs/promises';
import { basename, join } from 'node:path';
import type { Logger } from 'pino';
import type { HostMetricsResponse, InitExit, MetricSample, OomKill, OomReport } from '@fleet/agent-protocol';
import { sandboxNotFound } from '../../backend.js';
import type { SandboxObserver } from '../../observe.js';
import type { Cgroups } from './cgroups.js';
import { processStartTime } from './exec-util.js';
import { readInitExit } from './init-status.js';
import { layerUsage } from './storage.js';

/**
 * Watches every sandbox of the process backend: OOM kills from the memory
 * cgroup's oom_kill counter (memory.events on v2, memory.oom_control on v1;
 * polled, so no eventfd and nothing to re-arm after an agent restart), the
 * init's death, and resource samples (cgroups, the host side of the veth,
 * the writable layer) kept in a short window per sandbox.
 *
 * The kernel log, which names an OOM victim, is not readable here: the
 * victim is named from what the agent saw — the processes of the group at
 * the previous poll (the one gone with the highest oom_score is the
 * kernel's pick), or an exec that ended with SIGKILL — else "unknown".
 */

export interface MonitorTarget {
  readonly name: string;
  readonly initPid: number;
  readonly initStart: string;
  readonly veth: string;
  readonly ramMb: number;
  readonly sandboxDir: string;
  readonly storageGb: number;
}

export interface MonitorOptions {
  readonly cgroups: Cgroups;
  readonly intervalMs: number;
  readonly window: number;
  /** OOM polls are more frequent than samples: a victim is named from the processes seen at the previous poll. */
  readonly oomPollMs: number;
  /** Console logs of ended sandboxes, kept for `logRetentionMs` after the destroy. */
  readonly logsDir: string;
  readonly logRetentionMs: number;
  readonly targets: () => MonitorTarget[];
  /** Where a sandbox's directory is (read while its teardown is in progress). */
  readonly sandboxDirOf: (name: string) => string;
  readonly log?: Logger | undefined;
}

interface Proc {
  readonly comm: string;
  readonly nsPid: number | undefined;
  readonly score: number;
}

interface Watch {
  initStart: string;
  oomCount: number;
  events: OomKill[];
  alive: boolean;
  initOom: boolean;
  procs: Map<number, Proc>;
  killedExecs: string[];
  /** Kills counted at the last poll, named at this one. */
  pending: number;
  /** Processes gone in the poll interval the counter rose in: the candidates, highest oom_score first. */
  vanished: { process: string; pid?: number }[];
  samples: MetricSample[];
  diskAt: number;
  disk: number | null;
  limitMb: number;
}

const MAX_EVENTS = 32;
const DISK_EVERY_MS = 30_000;
const CONSOLE = 'console.log';

export class SandboxMonitor implements SandboxObserver {
  private readonly watches = new Map<string, Watch>();
  /** Execs SIGKILLed in a sandbox the monitor has not polled yet (a hog run right after the create): named at first sight. */
  private readonly earlyKills = new Map<string, string[]>();
  private sampleTimer: NodeJS.Timeout | undefined;
  private oomTimer: NodeJS.Timeout | undefined;
  /** The OOM pass in flight: a second caller shares it. */
  private polling: Promise<void> | undefined;
  private lastSweep = 0;

  constructor(private readonly opts: MonitorOptions) {}

  get intervalMs(): number {
    return this.opts.intervalMs;
  }

  get window(): number {
    return this.opts.window;
  }

  start(): void {
    const loop = (ms: number, fn: () => Promise<void>, set: (t: NodeJS.Timeout) => void): void => {
      const t = setTimeout(() => {
        void fn()
          .catch((err: unknown) => this.opts.log?.warn({ err }, 'sandbox monitor pass failed'))
          .finally(() => {
            if (this.sampleTimer !== undefined || this.oomTimer !== undefined) loop(ms, fn, set);
          });
      }, ms);
      t.unref();
      set(t);
    };
    loop(
      this.opts.oomPollMs,
      () => this.pollOom(),
      (t) => (this.oomTimer = t),
    );
    loop(
      this.opts.intervalMs,
      () => this.sampleAll(),
      (t) => (this.sampleTimer = t),
    );
  }

  stop(): void {
    clearTimeout(this.sampleTimer);
    clearTimeout(this.oomTimer);
    this.sampleTimer = undefined;
    this.oomTimer = undefined;
  }

  // ---- OOM ----------------------------------------------------------------------

  /** One OOM pass over every sandbox (public for tests, which do not wait for the timer). */
  pollOom(): Promise<void> {
    this.polling ??= this.oomPass().finally(() => {
      this.polling = undefined;
    });
    return this.polling;
  }

  /** A pass that starts now (after any in flight): a listing of a sandbox whose init just died says whether OOM ended it. */
  async settleOom(): Promise<void> {
    await this.polling?.catch(() => undefined);
    await this.pollOom();
  }

  private async oomPass(): Promise<void> {
    const targets = this.opts.targets();
    const names = new Set(targets.map((t) => t.name));
    for (const name of this.watches.keys()) if (!names.has(name)) this.watches.delete(name);
    for (const name of this.earlyKills.keys()) if (!names.has(name)) this.earlyKills.delete(name);
    await Promise.all(targets.map((t) => this.pollOne(t)));
    if (Date.now() - this.lastSweep > 60_000) {
      this.lastSweep = Date.now();
      await this.sweepLogs();
    }
  }

  private watchOf(t: MonitorTarget, count: number): Watch {
    let w = this.watches.get(t.name);
    if (w?.initStart !== t.initStart) {
      // First sight (or a new init under the same name): kills counted before are known by number only, except those of
      // execs that reported a SIGKILL before this poll: they count as risen now and are named at the next poll.
      const early = this.earlyKills.get(t.name) ?? [];
      this.earlyKills.delete(t.name);
      w = {
        initStart: t.initStart,
        oomCount: Math.max(0, count - early.length),
        events: [],
        alive: true,
        initOom: false,
        procs: new Map(),
        killedExecs: [...early],
        pending: 0,
        vanished: [],
        samples: [],
        diskAt: 0,
        disk: null,
        limitMb: t.ramMb,
      };
      this.watches.set(t.name, w);
    }
    return w;
  }

  private async pollOne(t: MonitorTarget): Promise<void> {
    const count = await this.readOomCount(t.name);
    if (count === null) return;
    const w = this.watchOf(t, count);
    const alive = w.alive && (await processStartTime(t.initPid)) === t.initStart;
    const now = new Date().toISOString();
    const diedNow = w.alive && !alive;
    const rose = count - w.oomCount;
    if (rose > 0) {
      // Gone since the previous poll: the victim among them, unless it lived shorter than a poll. Our own helpers
      // (the exec relay) die with their command and are never the kernel's pick.
      const vanished = new Map(w.procs);
      if (alive) for (const pid of await this.groupPids(t.name)) vanished.delete(pid);
      if (diedNow) vanished.delete(t.initPid);
      w.vanished.push(
        ...[...vanished.values()]
          .filter((p) => !p.comm.startsWith('fleet-sandbox'))
          .sort((a, b) => b.score - a.score)
          .map((p) => ({ process: p.comm, ...(p.nsPid ? { pid: p.nsPid } : {}) })),
      );
    }
    // A kill is named one poll later (unless the init died of it): the exec that died of it has reported by then, and
    // its own word (argv[0]) beats a guess from the processes seen.
    const due = w.pending;
    // The init's death kills every process of its namespace. A kill counted in this interval, or in the previous one
    // and not yet named (a large process takes a while to exit under load), was the init's.
    const initKill = diedNow && rose + due > 0;
    w.pending = diedNow ? 0 : Math.max(0, rose);
    const unnamed = due + (diedNow ? Math.max(0, rose) : 0);
    if (unnamed > 0) {
      type Named = { process: string; pid?: number };
      const pool: Named[] = [...w.killedExecs.splice(0).map((e) => ({ process: e })), ...w.vanished];
      const unknown: Named = { process: 'unknown' };
      const names: Named[] = Array.from({ length: unnamed - (initKill ? 1 : 0) }, () => pool.shift() ?? unknown);
      if (initKill) names.push({ process: w.procs.get(t.initPid)?.comm ?? 'init', pid: 1 });
      const first = count - w.pending - unnamed;
      names.forEach((c, i) => w.events.push({ count: first + i + 1, process: c.process, ...(c.pid ? { pid: c.pid } : {}), at: now }));
      if (w.events.length > MAX_EVENTS) w.events.splice(0, w.events.length - MAX_EVENTS);
      w.vanished.length = 0;
      this.opts.log?.warn({ sandbox: t.name, oom_kills: count, events: w.events.slice(-unnamed) }, 'OOM kill in a sandbox');
    }
    if (diedNow) {
      w.initOom = initKill;
      w.alive = false;
    }
    w.oomCount = count;
    // A note is kept only while a kill waits for its name.
    if (w.pending === 0) w.killedExecs.length = 0;
    w.procs = alive ? await this.snapshot(t.name) : new Map<number, Proc>();
  }

  noteKilledExec(name: string, process: string): void {
    const note = basename(process).slice(0, 64) || 'unknown';
    const w = this.watches.get(name);
    if (w) {
      w.killedExecs.push(note);
      return;
    }
    const early = this.earlyKills.get(name) ?? [];
    if (early.length < MAX_EVENTS) early.push(note);
    this.earlyKills.set(name, early);
  }

  async initExit(name: string): Promise<InitExit | undefined> {
    const t = this.opts.targets().find((x) => x.name === name);
    if (!t || (await processStartTime(t.initPid)) === t.initStart) return undefined;
    return readInitExit(t.sandboxDir, t.initPid, t.initStart);
  }

  /**
   * The counter before an exec starts. It also starts the sandbox's watch when no poll has yet: a first poll that
   * came between the exec's OOM kill and its report would take that kill as one from before and never name it.
   */
  async oomKills(name: string): Promise<number> {
    const count = await this.readOomCount(name);
    if (count === null) return 0;
    const t = this.watches.has(name) ? undefined : this.opts.targets().find((x) => x.name === name);
    if (t) this.watchOf(t, count);
    return count;
  }

  oom(name: string): OomReport | undefined {
    const w = this.watches.get(name);
    if (!w) return undefined;
    // Kills still waiting for a name are left out until the next poll names them: a reader would otherwise record them as unknown.
    return { kills: w.oomCount - w.pending, limit_mb: w.limitMb, events: [...w.events], init_oom_killed: w.initOom };
  }

  private async readOomCount(name: string): Promise<number | null> {
    const dir = this.opts.cgroups.controllerDir(name, 'memory');
    if (!dir) return null;
    const file = this.opts.cgroups.version === 2 ? 'memory.events' : 'memory.oom_control';
    const text = await readFile(join(dir, file), 'utf8').catch(() => null);
    if (text === null) return null;
    const m = /^oom_kill (\d+)$/m.exec(text);
    return m ? Number(m[1]) : 0;
  }

  private async groupPids(name: string): Promise<number[]> {
    const dir = this.opts.cgroups.controllerDir(name, 'memory');
    if (!dir) return [];
    const text = await readFile(join(dir, 'cgroup.procs'), 'utf8').catch(() => '');
    return text
      .split('\n')
      .filter((l) => l.trim())
      .map(Number);
  }

  private async snapshot(name: string): Promise<Map<number, Proc>> {
    const out = new Map<number, Proc>();
    await Promise.all(
      (await this.groupPids(name)).map(async (pid) => {
        const [comm, score, status] = await Promise.all([
          readFile(`/proc/${pid}/comm`, 'utf8').catch(() => null),
          readFile(`/proc/${pid}/oom_score`, 'utf8').catch(() => null),
          readFile(`/proc/${pid}/status`, 'utf8').catch(() => null),
        ]);
        if (comm === null) return;
        const ns = /^NSpid:\s+(.*)$/m
          .exec(status ?? '')?.[1]
          ?.trim()
          .split(/\s+/);
        const nsPid = ns && ns.length > 1 ? Number(ns[ns.length - 1]) : undefined;
        out.set(pid, { comm: comm.trim(), nsPid, score: Number(score ?? 0) });
      }),
    );
    return out;
  }

  // ---- samples ------------------------------------------------------------------

  /** One sample of every sandbox (public for tests). */
  async sampleAll(): Promise<void> {
    await Promise.all(this.opts.targets().map((t) => this.sampleOne(t)));
  }

  private async sampleOne(t: MonitorTarget): Promise<void> {
    const count = await this.readOomCount(t.name);
    const w = this.watchOf(t, count ?? 0);
    const cg = this.opts.cgroups;
    const num = async (dir: string | undefined, file: string): Promise<number | null> => {
      if (!dir) return null;
      const text = await readFile(join(dir, file), 'utf8').catch(() => null);
      if (text === null) return null;
      const n = Number(text.trim());
      return Number.isFinite(n) ? n : null;
    };
    const field = async (dir: string | undefined, file: string, key: string): Promise<number | null> => {
      if (!dir) return null;
      const text = await readFile(join(dir, file), 'utf8').catch(() => '');
      const m = new RegExp(`^${key} (\\d+)$`, 'm').exec(text);
      return m ? Number(m[1]) : null;
    };
    const v2 = cg.version === 2;
    const mem = cg.controllerDir(t.name, 'memory');
    const [cpu, memory, peak, pids, hostRx, hostTx] = await Promise.all([
      v2
        ? field(cg.controllerDir(t.name, 'cpu'), 'cpu.stat', 'usage_usec')
        : num(cg.controllerDir(t.name, 'cpuacct'), 'cpuacct.usage').then((ns) => (ns === null ? null : Math.round(ns / 1000))),
      num(mem, v2 ? 'memory.current' : 'memory.usage_in_bytes'),
      num(mem, v2 ? 'memory.peak' : 'memory.max_usage_in_bytes'),
      num(cg.controllerDir(t.name, 'pids'), 'pids.current'),
      num(`/sys/class/net/${t.veth}/statistics`, 'rx_bytes'),
      num(`/sys/class/net/${t.veth}/statistics`, 'tx_bytes'),
    ]);
    const now = Date.now();
    if (now - w.diskAt >= DISK_EVERY_MS) {
      w.diskAt = now;
      w.disk = await layerUsage(t.sandboxDir, t.storageGb).then(
        (u) => u.used_bytes,
        () => w.disk,
      );
    }
    w.samples.push({
      t: now,
      cpu_usec: cpu,
      memory_bytes: memory ?? 0,
      memory_peak_bytes: peak,
      disk_used_bytes: w.disk,
      // The host side of the veth: what it receives, the guest sent.
      net_rx_bytes: hostTx ?? 0,
      net_tx_bytes: hostRx ?? 0,
      pids: pids ?? 0,
    });
    if (w.samples.length > this.opts.window) w.samples.splice(0, w.samples.length - this.opts.window);
  }

  metrics(name: string, sinceMs: number): MetricSample[] {
    if (!this.opts.targets().some((t) => t.name === name)) throw sandboxNotFound(name);
    return (this.watches.get(name)?.samples ?? []).filter((s) => s.t > sinceMs);
  }

  host(): HostMetricsResponse {
    const names = new Set(this.opts.targets().map((t) => t.name));
    const out: HostMetricsResponse = {
      sandboxes: names.size,
      cpu_usec_total: 0,
      memory_bytes: 0,
      net_rx_bytes_total: 0,
      net_tx_bytes_total: 0,
      pids: 0,
      oom_kills_total: 0,
    };
    for (const [name, w] of this.watches) {
      if (!names.has(name)) continue;
      out.oom_kills_total += w.oomCount;
      const s = w.samples.at(-1);
      if (!s) continue;
      out.cpu_usec_total += s.cpu_usec ?? 0;
      out.memory_bytes += s.memory_bytes;
      out.net_rx_bytes_total += s.net_rx_bytes;
      out.net_tx_bytes_total += s.net_tx_bytes;
      out.pids += s.pids;
    }
    return out;
  }

  // ---- console logs -------------------------------------------------------------

  /**
   * Called by the teardown before the sandbox directory goes: its console log
   * (and the rotated one) move to logsDir/<name>, with the time it ended, and
   * stay readable until the retention after that has passed.
   */
  async keepLogs(name: string, sandboxDir: string): Promise<void> {
    if (this.opts.logRetentionMs <= 0) return;
    const files = [`${CONSOLE}.1`, CONSOLE].filter((f) => existsSync(join(sandboxDir, f)));
    if (files.length === 0) return;
    // Hard links into a staging directory renamed into place: a reader sees the live files or the kept ones, never a
    // half-moved pair (the writer may still append its last bytes: same inode).
    const dest = join(this.opts.logsDir, name);
    const staging = join(this.opts.logsDir, `.tmp-${name}`);
    await rm(staging, { recursive: true, force: true });
    await mkdir(staging, { recursive: true, mode: 0o700 });
    for (const f of files) await link(join(sandboxDir, f), join(staging, f));
    await writeFile(join(staging, 'ended'), new Date().toISOString());
    await rm(dest, { recursive: true, force: true });
    await rename(staging, dest);
  }

  logFiles(name: string): Promise<{ files: string[]; ended: boolean } | null> {
    const live = this.opts.targets().find((t) => t.name === name);
    const kept = join(this.opts.logsDir, name);
    const ended = !live && existsSync(join(kept, 'ended'));
    const dir = live ? live.sandboxDir : ended ? kept : this.opts.sandboxDirOf(name);
    const files = [`${CONSOLE}.1`, CONSOLE].map((f) => join(dir, f)).filter((f) => existsSync(f));
    // Not live, not kept: a teardown in progress still has its files; otherwise there is nothing.
    if (!live && !ended && files.length === 0) return Promise.resolve(null);
    return Promise.resolve({ files, ended });
  }

  /** Removes kept logs past their retention (the destroy was acknowledged that long ago). */
  async sweepLogs(now = Date.now()): Promise<string[]> {
    const removed: string[] = [];
    for (const name of await readdir(this.opts.logsDir).catch(() => [] as string[])) {
      if (name.startsWith('.tmp-')) {
        await rm(join(this.opts.logsDir, name), { recursive: true, force: true });
        continue;
      }
      const dir = join(this.opts.logsDir, name);
      const ended = await readFile(join(dir, 'ended'), 'utf8').then(
        (s) => Date.parse(s.trim()),
        async () => (await stat(dir).catch(() => null))?.mtimeMs ?? now,
      );
      if (now - ended >= this.opts.logRetentionMs) {
        await rm(dir, { recursive: true, force: true });
        removed.push(name);
      }
    }
    return removed;
  }
}
