import { z } from 'zod';

/** What every backend accepts for a sandbox's name, tenant, guest environment keys and published ports. */
export const nameRe = /^[a-z0-9][a-z0-9-]{0,62}$/;
export const tenantRe = /^[a-z0-9][a-z0-9_-]{0,62}$/;
export const envKeyRe = /^[A-Za-z_][A-Za-z0-9_]*$/;

export const exposeSchema = z.object({
  port: z.number().int().min(1).max(65535),
  as: z.string().min(1).max(63),
  protocol: z.enum(['tcp', 'udp']).optional(),
});
