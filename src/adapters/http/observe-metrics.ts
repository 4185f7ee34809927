import type { HostMetricsResponse } from '@fleet/agent-protocol';
import type { HostCommands } from '../../commands/host/host-commands.js';
import type { Metrics } from './metrics.js';

const FIELDS: ReadonlyArray<[keyof HostMetricsResponse, string, string]> = [
  ['sandboxes', 'fleet_host_sandboxes', 'Sandboxes the host agent runs (its own count)'],
  ['cpu_usec_total', 'fleet_host_sandbox_cpu_seconds', "CPU time of the host's live sandboxes, summed (seconds; falls when one ends)"],
  ['memory_bytes', 'fleet_host_sandbox_memory_bytes', "Memory charged to the host's sandboxes, summed"],
  ['net_rx_bytes_total', 'fleet_host_sandbox_network_receive_bytes', "Bytes the host's live sandboxes received, summed"],
  ['net_tx_bytes_total', 'fleet_host_sandbox_network_transmit_bytes', "Bytes the host's live sandboxes sent, summed"],
  ['pids', 'fleet_host_sandbox_pids', "Processes in the host's sandboxes"],
  ['oom_kills_total', 'fleet_host_sandbox_oom_kills', "OOM kills counted in the host's live sandboxes"],
];

/**
 * Per-host aggregates of the sandbox monitors for /metrics: one series per
 * host, never one per VM (a fleet's VM count would be the scrape's
 * cardinality). Asked of every schedulable host at scrape time, once per
 * scrape however many gauges read it, each host bounded by a short timeout:
 * a host that does not answer is left out of that scrape.
 */
export function registerHostObserveMetrics(
  metrics: Metrics,
  hosts: HostCommands,
  hostIds: () => Promise<string[]>,
  timeoutMs = 2000,
): void {
  let inflight: { at: number; values: Promise<Array<{ host: string; m: HostMetricsResponse }>> } | undefined;
  const collect = (): Promise<Array<{ host: string; m: HostMetricsResponse }>> => {
    if (inflight && Date.now() - inflight.at < 1000) return inflight.values;
    const values = (async () => {
      const ids = await hostIds();
      const got = await Promise.all(
        ids.map(async (host) => {
          try {
            const agent = await hosts.agentFor(host);
            return agent.hostMetrics ? [{ host, m: await agent.hostMetrics({ timeoutMs }) }] : [];
          } catch {
            return [];
          }
        }),
      );
      return got.flat();
    })();
    inflight = { at: Date.now(), values };
    return values;
  };
  for (const [field, name, help] of FIELDS) {
    metrics.gauge(name, help, ['host_id'], async () =>
      (await collect()).map(({ host, m }) => ({
        labels: { host_id: host },
        value: field === 'cpu_usec_total' ? m[field] / 1e6 : m[field],
      })),
    );
  }
}
