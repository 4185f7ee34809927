import { E2B_ENVD_PREFIX, E2B_PREFIX } from './e2b-auth.js';

/**
 * The lines a user pastes into a shell to point the stock `e2b` SDK at this
 * control plane. `apiUrl` is where the API listens (`http://host:port`);
 * envd goes to the ingress (`ingressUrl`, routed by the SDK's E2b-Sandbox-Id
 * header) when this process runs one, else to the API's own relay. A
 * wildcard listen address is printed as loopback, which a client can dial.
 * The key line only when a key is to be shown (the demo key, on first start).
 */
export function e2bShellExports(apiUrl: string, apiKey?: string, ingressUrl?: string): string {
  const dialable = (url: string): string => url.replace(/\/$/, '').replace(/^(https?:\/\/)(0\.0\.0\.0|\[::\]|::)(?=[:/]|$)/, '$1127.0.0.1');
  const base = dialable(apiUrl);
  const sandboxUrl = ingressUrl !== undefined ? dialable(ingressUrl) : `${base}${E2B_ENVD_PREFIX}`;
  const lines = [`export E2B_API_URL=${base}${E2B_PREFIX}`, `export E2B_SANDBOX_URL=${sandboxUrl}`];
  if (apiKey !== undefined) lines.push(`export E2B_API_KEY=${apiKey}`);
  return `${lines.join('\n')}\n`;
}
