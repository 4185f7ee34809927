import type { FastifyRequest } from 'fastify';
import { ForbiddenError, UnauthorizedError } from '../../domain/errors.js';
import { safeEqual } from '../crypto.js';

/** Who is calling. The tenant comes from the key and nothing else (the seed's callerTenantID). */
export interface Caller {
  readonly tenantId: string;
  readonly admin: boolean;
  /** For event metadata: never the key itself. */
  readonly actor: string;
}

export interface ApiKey {
  readonly key: string;
  readonly tenant: string;
  readonly admin: boolean;
}

/** The admin key acts as tenant `admin` when it creates things, and sees every tenant when it reads. */
export const ADMIN_TENANT = 'admin';

export class ApiKeys {
  constructor(private readonly keys: readonly ApiKey[]) {}

  authenticate(req: FastifyRequest): Caller {
    const header = req.headers.authorization;
    if (!header) throw new UnauthorizedError('missing Authorization header: send "Authorization: Bearer <api key>"');
    const match = /^Bearer\s+(\S+)\s*$/i.exec(header);
    if (!match) throw new UnauthorizedError('Authorization header must be "Bearer <api key>"');
    const presented = match[1]!;
    // Compare against every key, always: the time taken does not say which key came close.
    let found: ApiKey | undefined;
    for (const k of this.keys) if (safeEqual(presented, k.key) && !found) found = k;
    if (!found) throw new UnauthorizedError('unknown API key');
    return { tenantId: found.tenant, admin: found.admin, actor: found.admin ? 'admin' : `tenant:${found.tenant}` };
  }
}

export function requireAdmin(caller: Caller): void {
  if (!caller.admin) throw new ForbiddenError('this route needs the admin key');
}

declare module 'fastify' {
  interface FastifyRequest {
    caller: Caller;
  }
}
