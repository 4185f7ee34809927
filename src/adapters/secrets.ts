import { randomBytes } from 'node:crypto';
import { chmod, mkdir, readFile, writeFile, rename } from 'node:fs/promises';
import { join } from 'node:path';
import { z } from 'zod';

/**
 * Secrets the embedded default generates on first start so `npm start` works
 * with nothing configured: the token-encryption key, the admin key, a demo
 * tenant's key, the local agent's token and the embedded Postgres password.
 * Kept in DATA_DIR/secrets.json (mode 0600) so they survive restarts; an
 * environment variable always wins.
 */
const secretsSchema = z.object({
  token_encryption_key: z.string(),
  admin_api_key: z.string(),
  demo_api_key: z.string(),
  local_agent_token: z.string(),
  embedded_pg_password: z.string().min(16),
});
export type GeneratedSecrets = z.infer<typeof secretsSchema>;

/** A file written before the Postgres password was generated lacks it: it is added, the rest kept. */
const storedSchema = secretsSchema.extend({ embedded_pg_password: z.string().min(16).optional() });

export interface LoadedSecrets {
  readonly secrets: GeneratedSecrets;
  /** True when this call generated the keys (first start): the only time they are printed. */
  readonly created: boolean;
}

export function secretsFile(dataDir: string): string {
  return join(dataDir, 'secrets.json');
}

/** The file as it is, without generating anything (the CLI); one from before the Postgres password lacks it. */
export async function readSecrets(dataDir: string): Promise<z.infer<typeof storedSchema> | undefined> {
  try {
    return storedSchema.parse(JSON.parse(await readFile(secretsFile(dataDir), 'utf8')));
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return undefined;
    throw new Error(`${secretsFile(dataDir)} is unreadable or malformed; fix or delete it: ${(err as Error).message}`);
  }
}

export async function loadOrCreateSecrets(dataDir: string): Promise<LoadedSecrets> {
  const file = secretsFile(dataDir);
  try {
    const stored = storedSchema.parse(JSON.parse(await readFile(file, 'utf8')));
    if (stored.embedded_pg_password !== undefined)
      return { secrets: { ...stored, embedded_pg_password: stored.embedded_pg_password }, created: false };
    const secrets = { ...stored, embedded_pg_password: randomPassword() };
    await writeAtomically(file, secrets);
    return { secrets, created: false };
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'ENOENT')
      throw new Error(`${file} is unreadable or malformed; fix or delete it: ${(err as Error).message}`);
  }
  const secrets: GeneratedSecrets = {
    token_encryption_key: randomBytes(32).toString('base64'),
    admin_api_key: `adm_${randomBytes(24).toString('base64url')}`,
    demo_api_key: `demo_${randomBytes(24).toString('base64url')}`,
    local_agent_token: randomBytes(32).toString('base64url'),
    embedded_pg_password: randomPassword(),
  };
  await mkdir(dataDir, { recursive: true });
  await writeAtomically(file, secrets);
  return { secrets, created: true };
}

function randomPassword(): string {
  return randomBytes(24).toString('base64url');
}

async function writeAtomically(file: string, secrets: GeneratedSecrets): Promise<void> {
  const tmp = `${file}.${process.pid}.tmp`;
  await writeFile(tmp, JSON.stringify(secrets, null, 2), { mode: 0o600 });
  await chmod(tmp, 0o600);
  await rename(tmp, file);
}
