import type { Logger } from 'pino';
import type { HostAgent } from '../../domain/host-agent.port.js';
import { sandboxName } from '../vm/vm-commands.js';
import { errInfo, type LiveVmHint, type ReconcilerConfig, type ReconcileSummary } from './reconcile-types.js';

/** What the reconciler asks of a reachable host each cycle besides its listing: network boundary, egress endpoints. */
export class HostChecks {
  constructor(
    private readonly config: ReconcilerConfig,
    private readonly logger: Logger,
  ) {}

  /**
   * Asks the VM's host to probe its proxy endpoint. An unhealthy proxy is
   * counted and logged, and nothing else: the VM is never switched to direct.
   */
  async probeEgress(hostId: string, agent: HostAgent, h: LiveVmHint, s: ReconcileSummary, endpoints: Map<string, number>): Promise<void> {
    const provider = h.egress_proxy ?? '';
    let health: string;
    try {
      health = (await agent.egressStatus(sandboxName(h.id), { timeoutMs: this.config.agentTimeoutMs })).health ?? 'unknown';
    } catch (err) {
      health = 'unknown';
      this.logger.warn({ vm_id: h.id, host_id: hostId, err: errInfo(err) }, 'egress probe got no answer from the host');
    }
    s.egress_checked++;
    if (health !== 'healthy') {
      s.egress_unhealthy++;
      this.logger.warn(
        { vm_id: h.id, host_id: hostId, provider, health },
        'egress proxy endpoint unhealthy: the VM has no egress until it recovers',
      );
    }
    const key = `${provider}\0${health}`;
    endpoints.set(key, (endpoints.get(key) ?? 0) + 1);
  }

  /**
   * The host puts its sandbox network boundary back wherever something
   * changed it since the last cycle (a sysctl reload, a hand-edited ruleset);
   * the repairs are counted, and each one is a finding worth a look.
   */
  async reassertNetwork(hostId: string, agent: HostAgent, s: ReconcileSummary): Promise<void> {
    try {
      const r = await agent.reassertNetwork({ timeoutMs: this.config.agentTimeoutMs });
      s.network_repairs += r.repaired;
      if (r.repaired > 0) this.logger.warn({ host_id: hostId, repairs: r.repairs }, 'host network boundary had drifted: repaired');
    } catch (err) {
      s.errors++;
      this.logger.warn({ host_id: hostId, err: errInfo(err) }, 'host could not reassert its network boundary');
    }
  }
}
