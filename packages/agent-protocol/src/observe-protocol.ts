import { z } from 'zod';

/**
 * What the host agent observes of its sandboxes: OOM kills (from the memory
 * cgroup's counter), resource samples (cgroups and the veth) and the console
 * log. The counter is the kernel's, so an agent restart loses the names of
 * the processes killed before it, never the count.
 */

export const oomKillSchema = z.object({
  /** The cgroup's oom_kill counter after this kill (1 for the first). */
  count: z.number().int().positive(),
  /** Command name of the killed process as the agent last saw it (comm, or the exec's argv[0]); "unknown" when it could not tell. */
  process: z.string(),
  /** Pid inside the sandbox, when known. */
  pid: z.number().int().positive().optional(),
  at: z.string(),
});
export type OomKill = z.infer<typeof oomKillSchema>;

export const oomReportSchema = z.object({
  /** The memory cgroup's oom_kill counter. */
  kills: z.number().int().nonnegative(),
  limit_mb: z.number().int().nonnegative(),
  /** The last kills the agent attributed (at most 32, oldest first). */
  events: z.array(oomKillSchema),
  /** The init is gone and the counter rose in the interval it died in: the sandbox ended of an OOM kill. */
  init_oom_killed: z.boolean(),
});
export type OomReport = z.infer<typeof oomReportSchema>;

/**
 * How a stopped sandbox's init ended, as its parent recorded it: an exit code,
 * or the signal that killed it (an OOM kill is SIGKILL). Absent when the host
 * has no record of it (a backend or sandbox without the reaper, e.g. one
 * restored from a checkpoint).
 */
export const initExitSchema = z.union([
  z.object({ exit_code: z.number().int().min(0).max(255) }).strict(),
  z.object({ exit_signal: z.string().regex(/^SIG[A-Z0-9]+$/) }).strict(),
]);
export type InitExit = z.infer<typeof initExitSchema>;

export const metricSampleSchema = z.object({
  /** Unix milliseconds. */
  t: z.number().int(),
  /** Cumulative CPU time of the sandbox's cgroup, microseconds (null when the host has no CPU accounting for it). */
  cpu_usec: z.number().nonnegative().nullable(),
  memory_bytes: z.number().nonnegative(),
  /** Peak memory since the sandbox started (null where the kernel keeps none). */
  memory_peak_bytes: z.number().nonnegative().nullable(),
  /** Writable layer on disk (refreshed at most every 30 s: a walk of the layer without a disk of its own). */
  disk_used_bytes: z.number().nonnegative().nullable(),
  /** Guest's view: bytes it received / sent through its eth0. */
  net_rx_bytes: z.number().nonnegative(),
  net_tx_bytes: z.number().nonnegative(),
  pids: z.number().int().nonnegative(),
});
export type MetricSample = z.infer<typeof metricSampleSchema>;

export const metricsQuerySchema = z.object({
  /** Unix milliseconds: samples strictly after. */
  since: z.coerce.number().int().nonnegative().default(0),
});

export const metricsResponseSchema = z.object({
  interval_ms: z.number().int().positive(),
  /** How many samples the agent keeps per sandbox. */
  window: z.number().int().positive(),
  samples: z.array(metricSampleSchema),
});
export type MetricsResponse = z.infer<typeof metricsResponseSchema>;

/** Per-host aggregates over every sandbox of the agent (for /metrics: never one series per VM). */
export const hostMetricsResponseSchema = z.object({
  sandboxes: z.number().int().nonnegative(),
  cpu_usec_total: z.number().nonnegative(),
  memory_bytes: z.number().nonnegative(),
  net_rx_bytes_total: z.number().nonnegative(),
  net_tx_bytes_total: z.number().nonnegative(),
  pids: z.number().int().nonnegative(),
  oom_kills_total: z.number().int().nonnegative(),
});
export type HostMetricsResponse = z.infer<typeof hostMetricsResponseSchema>;

/**
 * `GET /v1/vms/:name/logs?offset=`: the console log from a byte offset.
 * `offset` counts bytes of the whole log: the previous file (after a
 * rotation) first, then the current one. Logs of a destroyed sandbox stay
 * readable for the agent's retention (`ended: true`).
 */
export const logsQuerySchema = z.object({
  offset: z.coerce.number().int().nonnegative().optional(),
  /** Without offset: the last this many bytes. */
  tail_bytes: z.coerce
    .number()
    .int()
    .min(1)
    .max(16 * 1024 * 1024)
    .default(256 * 1024),
  max_bytes: z.coerce
    .number()
    .int()
    .min(1)
    .max(4 * 1024 * 1024)
    .default(1024 * 1024),
});

export const logsResponseSchema = z.object({
  /** The bytes, base64 (a chunk may end inside a UTF-8 sequence). */
  data: z.string(),
  offset: z.number().int().nonnegative(),
  next_offset: z.number().int().nonnegative(),
  size: z.number().int().nonnegative(),
  /** The sandbox is gone: nothing more will be written. */
  ended: z.boolean(),
});
export type LogsResponse = z.infer<typeof logsResponseSchema>;
