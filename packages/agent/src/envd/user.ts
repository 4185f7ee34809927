import { Code, ConnectError } from '@connectrpc/connect';

/**
 * The header the control plane forwards the SDK's `Authorization: Basic
 * base64("<user>:")` in (the agent's own Authorization carries its host token).
 */
export const ENVD_USER_HEADER = 'x-e2b-authorization';

/**
 * envd runs everything as the guest's root (the process backend's spawn has
 * no user switch): naming another user is refused, never silently ignored.
 */
export function requestedUser(headers: Headers | Record<string, string | string[] | undefined>, query?: string): string | undefined {
  if (query) return query;
  const raw = headers instanceof Headers ? headers.get(ENVD_USER_HEADER) : headers[ENVD_USER_HEADER];
  const value = Array.isArray(raw) ? raw[0] : raw;
  if (!value) return undefined;
  const encoded = /^Basic\s+([A-Za-z0-9+/=]+)$/i.exec(value)?.[1];
  if (!encoded) return undefined;
  const decoded = Buffer.from(encoded, 'base64').toString('utf8');
  return decoded.split(':')[0] || undefined;
}

export function userProblem(user: string | undefined): string | undefined {
  if (user === undefined || user === 'root') return undefined;
  return `user '${user}': this sandbox's envd runs every process and file operation as root; pass user 'root' or none`;
}

export function requireRootUser(headers: Headers): void {
  const problem = userProblem(requestedUser(headers));
  if (problem) throw new ConnectError(problem, Code.Unauthenticated);
}
