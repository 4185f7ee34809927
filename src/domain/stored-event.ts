import type { z } from 'zod';
import { AppError, describeFields, fieldsFromZod } from '@fleet/agent-protocol';

/**
 * Reads a stored event (type + data) back through its aggregate's event
 * schema. A mismatch is `STORED_EVENT_INVALID` (500): the store holds
 * something the code cannot fold, which is never the caller's fault.
 */
export function parseStoredEvent<S extends z.ZodType>(schema: S, type: string, data: unknown): z.output<S> {
  const parsed = schema.safeParse({ type, data });
  if (!parsed.success) {
    throw new AppError(
      'STORED_EVENT_INVALID',
      500,
      `stored ${type} event does not match its schema: ${describeFields(fieldsFromZod(parsed.error))}`,
    );
  }
  return parsed.data;
}
