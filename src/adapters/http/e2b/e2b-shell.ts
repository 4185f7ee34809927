import { E2B_ENVD_PREFIX, E2B_PREFIX } from './e2b-auth.js';

/**
 * The lines a user pastes into a shell to point the stock `e2b` SDK at this
 * control plane. `apiUrl` is where the API listens (`http://host:port`); a
 * wildcard listen address is printed as loopback, which a client can dial.
 * The key line only when a key is to be shown (the demo key, on first start).
 */
export function e2bShellExports(apiUrl: string, apiKey?: string): string {
  const base = apiUrl.replace(/\/$/, '').replace(/^(https?:\/\/)(0\.0\.0\.0|\[::\]|::)(?=[:/]|$)/, '$1127.0.0.1');
  const lines = [`export E2B_API_URL=${base}${E2B_PREFIX}`, `export E2B_SANDBOX_URL=${base}${E2B_ENVD_PREFIX}`];
  if (apiKey !== undefined) lines.push(`export E2B_API_KEY=${apiKey}`);
  return `${lines.join('\n')}\n`;
}
