import { z } from 'zod';
import { ValidationError, type EgressSpec } from '@fleet/agent-protocol';

/**
 * The operator's egress proxy providers (`EGRESS_PROXIES`, JSON): name →
 * provider. One kind exists: `agent`, the HTTP CONNECT and forward proxy
 * every host agent runs on its sandboxes' gateway address (the project's
 * own provider; the boot provisions its endpoint on the VM's host). No
 * registry, or a provider not in it, refuses a proxy-mode VM: it is never
 * booted direct instead.
 */
export const egressProviderSchema = z.discriminatedUnion('kind', [z.object({ kind: z.literal('agent') }).strict()]);
export const egressRegistrySchema = z.record(
  z.string().regex(/^[a-z0-9][a-z0-9_-]{0,62}$/, 'a provider name: lowercase letters, digits, _ and -'),
  egressProviderSchema,
);
export type EgressRegistry = z.infer<typeof egressRegistrySchema>;

export const EGRESS_PROXY_NOT_CONFIGURED = 'EGRESS_PROXY_NOT_CONFIGURED';
export const EGRESS_PROVIDER_UNKNOWN = 'EGRESS_PROVIDER_UNKNOWN';

/** Refuses a proxy-mode policy the registry cannot serve; anything else passes. */
export function assertEgressProvisionable(egress: EgressSpec | undefined, registry: EgressRegistry | undefined): void {
  if (egress?.mode !== 'proxy') return;
  const names = Object.keys(registry ?? {});
  if (names.length === 0)
    throw new ValidationError(
      'egress mode "proxy" needs an egress proxy registry, and this fleet has none (EGRESS_PROXIES): the VM is not booted direct instead',
      [{ path: 'egress.provider', message: 'no egress proxy providers are configured' }],
      EGRESS_PROXY_NOT_CONFIGURED,
    );
  if (egress.provider === undefined || !(egress.provider in (registry ?? {})))
    throw new ValidationError(
      `egress provider "${egress.provider ?? ''}" is not configured; known: ${names.join(', ')}`,
      [{ path: 'egress.provider', message: 'unknown provider' }],
      EGRESS_PROVIDER_UNKNOWN,
    );
}
