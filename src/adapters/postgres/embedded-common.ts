import { execFile } from 'node:child_process';
import { promisify } from 'node:util';

export class EmbeddedPostgresError extends Error {
  readonly code: string;
  constructor(code: string, message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = 'EmbeddedPostgresError';
    this.code = code;
  }
}

export const USER = 'postgres';
/** What every data directory was initialised with before passwords were generated: migrated away from on start. */
export const LEGACY_PASSWORD = 'postgres';
export const execFileAsync = promisify(execFile);
