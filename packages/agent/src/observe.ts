import type { HostMetricsResponse, InitExit, MetricSample, OomReport } from '@fleet/agent-protocol';

/**
 * What a backend observes of its sandboxes, beside running them: resource
 * samples, OOM kills and where the console log is (also after the sandbox
 * ended, for the retention). Served by routes/observe.routes.ts.
 */
export interface SandboxObserver {
  readonly intervalMs: number;
  readonly window: number;
  /** Samples after `sinceMs`; SANDBOX_NOT_FOUND for an unknown sandbox. */
  metrics(name: string, sinceMs: number): MetricSample[];
  /** The OOM facts of a running sandbox; undefined before its first sample. */
  oom(name: string): OomReport | undefined;
  /** A fresh OOM pass: after it, a sandbox whose init died says whether an OOM kill ended it. */
  settleOom(): Promise<void>;
  /** How the init of a sandbox whose init is gone ended, when its parent recorded it. */
  initExit?(name: string): Promise<InitExit | undefined>;
  /** The live oom_kill counter of the sandbox's memory cgroup (read now). */
  oomKills(name: string): Promise<number>;
  /** An exec that ended with SIGKILL: a candidate to name should the counter have risen. */
  noteKilledExec(name: string, process: string): void;
  /** The console log files, oldest first (rotated, then current); null when the agent keeps none for the name. */
  logFiles(name: string): Promise<{ files: string[]; ended: boolean } | null>;
  host(): HostMetricsResponse;
}
