import { z } from 'zod';

/** The process backend's options for the sandbox monitor (monitor.ts), merged into its option schema. */
export const monitorOptionsSchema = z.object({
  /** How often every sandbox is sampled (AGENT_METRICS_INTERVAL_MS). */
  metricsIntervalMs: z.number().int().min(100).default(5000),
  /** Samples kept per sandbox (AGENT_METRICS_WINDOW): 120 at 5 s is ten minutes. */
  metricsWindow: z.number().int().min(1).max(10_000).default(120),
  /** How often the OOM counters are read (AGENT_OOM_POLL_MS). */
  oomPollMs: z.number().int().min(50).default(1000),
  /** Console logs of destroyed sandboxes are kept this long after the destroy (AGENT_LOG_RETENTION_MS); 0 drops them with the sandbox. */
  logRetentionMs: z.number().int().min(0).default(3_600_000),
});
