import type { FastifyInstance, FastifyRequest } from 'fastify';
import { ForbiddenError, UnauthorizedError } from '@fleet/agent-protocol';
import { ADMIN_TENANT } from '../config.js';
import { safeEqual } from '../crypto.js';

export { ADMIN_TENANT };

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

/**
 * The admin key acts as tenant `admin` when it creates things, and sees every tenant when it reads.
 * Authority comes from `Caller.admin`, never from the tenant string; the id `admin` is reserved all the
 * same (config refuses it in API_KEYS, this constructor refuses it from any other source), so no tenant
 * key can own what the admin created, nor be mistaken for it by a tenant-id comparison.
 */
export class ApiKeys {
  constructor(private readonly keys: readonly ApiKey[]) {
    for (const k of keys) {
      if (k.admin !== (k.tenant === ADMIN_TENANT))
        throw new Error(`API key for tenant ${JSON.stringify(k.tenant)}: the tenant id "${ADMIN_TENANT}" is the admin key's alone`);
    }
  }

  /** Whether a bearer token is the admin key (for the open routes, which do not authenticate). */
  isAdminToken(presented: string): boolean {
    let hit = false;
    for (const k of this.keys) if (k.admin && safeEqual(presented, k.key)) hit = true;
    return hit;
  }

  authenticate(req: FastifyRequest): Caller {
    const header = req.headers.authorization;
    if (!header) throw new UnauthorizedError('missing Authorization header: send "Authorization: Bearer <api key>"');
    const match = /^Bearer\s+(\S+)\s*$/i.exec(header);
    const presented = match?.[1];
    if (presented === undefined) throw new UnauthorizedError('Authorization header must be "Bearer <api key>"');
    return this.authenticateKey(presented);
  }

  /** A key presented some other way than a bearer token (the E2B API's X-API-Key). */
  authenticateKey(presented: string): Caller {
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

/**
 * Makes every route of a plugin scope admin-only, checked at `onRequest`: before the body is read,
 * parsed or validated, so a tenant learns nothing of a route's schema (403 whatever it sends).
 */
export function adminOnly(scope: FastifyInstance): void {
  // eslint-disable-next-line @typescript-eslint/require-await -- fastify waits for done() unless a hook returns a promise
  scope.addHook('onRequest', async (req) => requireAdmin(req.caller));
}

/** The token of an `Authorization: Bearer <token>` header, or undefined. */
export function bearerOf(req: FastifyRequest): string | undefined {
  return /^Bearer\s+(\S+)\s*$/i.exec(req.headers.authorization ?? '')?.[1];
}

declare module 'fastify' {
  interface FastifyRequest {
    caller: Caller;
  }
}
