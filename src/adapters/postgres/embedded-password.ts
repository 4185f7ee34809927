import { randomBytes } from 'node:crypto';
import { promises as fs } from 'node:fs';
import pg from 'pg';
import type { Logger } from '../logger.js';
import { EmbeddedPostgresError, LEGACY_PASSWORD, USER } from './embedded-common.js';

/** The password for a data directory that was given none: random, kept beside it (mode 0600). */
export async function passwordFileFor(dataDir: string): Promise<string> {
  const file = `${dataDir}.password`;
  try {
    const text = (await fs.readFile(file, 'utf8')).trim();
    if (text !== '') return text;
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw err;
  }
  const password = randomBytes(24).toString('base64url');
  await fs.writeFile(file, `${password}\n`, { mode: 0o600 });
  await fs.chmod(file, 0o600);
  return password;
}

/**
 * A data directory initialised before passwords were generated still has the
 * constant one: log in with it once and set the generated one. Any other
 * refusal means the configured password is wrong for this data directory.
 */
export async function migrateLegacyPassword(port: number, password: string, logger: Logger | undefined): Promise<void> {
  const client = new pg.Client({ host: '127.0.0.1', port, user: USER, password: LEGACY_PASSWORD, database: 'postgres' });
  client.on('error', () => undefined);
  try {
    await client.connect();
  } catch (err) {
    await client.end().catch(() => undefined);
    throw new EmbeddedPostgresError(
      'EMBEDDED_PG_AUTH',
      'the embedded Postgres refuses the password kept for it (DATA_DIR/secrets.json or <data dir>.password): restore the file that goes with this data directory, or move the data directory away to start afresh',
      { cause: err },
    );
  }
  try {
    // The statement carries the password as a literal: keep it out of the server's log whatever its settings.
    await client.query(`SET log_statement = 'none'`);
    await client.query(`ALTER ROLE ${client.escapeIdentifier(USER)} PASSWORD ${client.escapeLiteral(password)}`);
    logger?.warn('the embedded Postgres had the old constant password; it now has the generated one');
  } finally {
    await client.end();
  }
}

export async function ensureDatabase(adminUrl: string, database: string): Promise<void> {
  const client = new pg.Client({ connectionString: adminUrl });
  await client.connect();
  try {
    const found = await client.query('SELECT 1 FROM pg_database WHERE datname = $1', [database]);
    if (found.rowCount === 0) {
      try {
        await client.query(`CREATE DATABASE ${client.escapeIdentifier(database)}`);
      } catch (err) {
        // two processes starting at once: the other one created it
        if ((err as { code?: string }).code !== '42P04') throw err;
      }
    }
  } finally {
    await client.end();
  }
}
