import type { HostAgentConnector } from '../domain/host-agent.port.js';

/**
 * TEST HOOK, for fault tests only: `FLEET_TEST_HOOK_AGENT_DELAY_MS=createVm=30000,destroyVm=30000`
 * makes every call of the named agent methods wait that long before it is
 * sent, to hold a create or destroy open at a known step while a test
 * SIGKILLs the control plane. Unset in production; a bad value is refused.
 */
export const TEST_HOOK_AGENT_DELAY = 'FLEET_TEST_HOOK_AGENT_DELAY_MS';

export function parseAgentDelayHook(value: string | undefined): Map<string, number> | undefined {
  if (!value) return undefined;
  const delays = new Map<string, number>();
  for (const part of value.split(',')) {
    const m = /^\s*([A-Za-z]+)=(\d+)\s*$/.exec(part);
    const method = m?.[1];
    if (method === undefined) throw new Error(`${TEST_HOOK_AGENT_DELAY}: "${part}" must be method=milliseconds, e.g. createVm=30000`);
    delays.set(method, Number(m?.[2]));
  }
  return delays;
}

export function withAgentDelays(connector: HostAgentConnector, delays: Map<string, number>): HostAgentConnector {
  return {
    connect(endpoint) {
      const agent = connector.connect(endpoint);
      return new Proxy(agent, {
        get(target, prop, receiver) {
          const value = Reflect.get(target, prop, receiver) as unknown;
          const ms = typeof prop === 'string' ? delays.get(prop) : undefined;
          if (typeof value !== 'function') return value;
          const fn = value as (...a: unknown[]) => unknown;
          if (ms === undefined) return fn.bind(target);
          return async (...args: unknown[]) => {
            await new Promise((r) => setTimeout(r, ms));
            return fn.apply(target, args);
          };
        },
      });
    },
  };
}
