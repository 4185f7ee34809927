import type { z } from 'zod';
import { ValidationError } from '@fleet/agent-protocol';

/** Parses a request part (body, query, param, websocket frame) or throws one ValidationError naming every bad field. */
export function parse<S extends z.ZodType>(schema: S, value: unknown, what: string): z.output<S> {
  const r = schema.safeParse(value);
  if (r.success) return r.data;
  const fields = r.error.issues.map((i) => ({ path: i.path.map(String).join('.'), message: i.message }));
  throw new ValidationError(`invalid ${what}: ${fields.map((f) => (f.path ? `${f.path}: ${f.message}` : f.message)).join('; ')}`, fields);
}
