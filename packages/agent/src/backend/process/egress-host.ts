import { connect } from 'node:net';
import { networkInterfaces } from 'node:os';
import type { Logger } from 'pino';
import { AppError, EGRESS_PROVISION_FAILED, type EgressHealth, type EgressStatus } from '@fleet/agent-protocol';
import { startEgressProxy, type EgressProxy } from './egress-proxy.js';
import { forwards, usesAgentProxy, type EgressHostConfig, type SandboxEgress } from './egress.js';

/**
 * The host side of egress for one agent: its egress proxy (started with the
 * first proxy-mode sandbox, on the gateway address, which exists once a
 * bridge does), what a sandbox's guest is told (HTTP_PROXY and friends),
 * and the health probe of a sandbox's proxy endpoint.
 */
export class EgressHost {
  private proxy: EgressProxy | undefined;
  private starting: Promise<EgressProxy> | undefined;

  constructor(
    readonly cfg: EgressHostConfig,
    private readonly policyOf: (ip: string) => SandboxEgress | undefined,
    private readonly dnsServers: readonly string[],
    private readonly log: Logger | undefined,
  ) {}

  /** Starts the agent's proxy unless it runs; the gateway address must be on a bridge by now. */
  async ensureProxy(): Promise<void> {
    if (this.proxy) return;
    this.starting ??= startEgressProxy({
      host: this.cfg.gateway,
      port: this.cfg.proxyPort,
      cfg: this.cfg,
      policyOf: this.policyOf,
      hostAddresses,
      dnsServers: this.dnsServers,
      logger: this.log,
    });
    try {
      this.proxy = await this.starting;
      this.log?.info({ address: `${this.cfg.gateway}:${this.cfg.proxyPort}` }, 'egress proxy listening');
    } catch (err) {
      // Its own code, so the control plane records an egress provision failure (not a bare sandbox failure).
      throw new AppError(
        EGRESS_PROVISION_FAILED,
        503,
        `the agent's egress proxy could not start on ${this.cfg.gateway}:${this.cfg.proxyPort}: ${(err as Error).message}`,
        {},
        { cause: err },
      );
    } finally {
      this.starting = undefined;
    }
  }

  async close(): Promise<void> {
    const p = this.proxy;
    this.proxy = undefined;
    await p?.close();
  }

  /** Where the guest's HTTP(S)_PROXY points; undefined outside proxy mode. */
  endpointOf(e: SandboxEgress): { host: string; port: number } | undefined {
    if (e.mode !== 'proxy') return undefined;
    return e.endpoint ?? { host: this.cfg.gateway, port: this.cfg.proxyPort };
  }

  /** The seed's GuestEgress: bare IPs in NO_PROXY (loopback, the guest's own address, the host side of its link). */
  status(e: SandboxEgress, guestIp: string, health?: EgressHealth): EgressStatus {
    const ep = this.endpointOf(e);
    return {
      mode: e.mode,
      ...(e.provider !== undefined ? { provider: e.provider } : {}),
      ...(ep ? { endpoint: `http://${ep.host}:${ep.port}`, no_proxy: ['127.0.0.1', guestIp, this.cfg.gateway] } : {}),
      ...(health ? { health } : {}),
    };
  }

  /** The variables a proxy-mode guest gets (both spellings: clients disagree on case). */
  guestEnv(e: SandboxEgress, guestIp: string): Record<string, string> {
    const s = this.status(e, guestIp);
    if (!s.endpoint) return {};
    const noProxy = (s.no_proxy ?? []).join(',');
    return {
      HTTP_PROXY: s.endpoint,
      HTTPS_PROXY: s.endpoint,
      http_proxy: s.endpoint,
      https_proxy: s.endpoint,
      NO_PROXY: noProxy,
      no_proxy: noProxy,
    };
  }

  /** A TCP connect to the endpoint from this host (2 s); direct and none have none to probe. */
  async health(e: SandboxEgress): Promise<EgressHealth | undefined> {
    const ep = this.endpointOf(e);
    if (!ep) return undefined;
    if (usesAgentProxy(e) && !this.proxy) return 'unhealthy';
    return new Promise<EgressHealth>((resolve) => {
      const sock = connect({ host: ep.host, port: ep.port });
      const timer = setTimeout(() => finish('unhealthy'), 2000);
      const finish = (h: EgressHealth): void => {
        clearTimeout(timer);
        sock.destroy();
        resolve(h);
      };
      sock.once('connect', () => finish('healthy'));
      sock.once('error', () => finish('unhealthy'));
    });
  }
}

export { forwards, usesAgentProxy };

/** Every IPv4 address of this host's interfaces. */
function hostAddresses(): ReadonlySet<string> {
  const out = new Set<string>();
  for (const list of Object.values(networkInterfaces())) for (const a of list ?? []) if (a.family === 'IPv4') out.add(a.address);
  return out;
}
