import { randomBytes } from 'node:crypto';
import { chmod, mkdir, readFile, writeFile, rename } from 'node:fs/promises';
import { join } from 'node:path';
import { z } from 'zod';

/**
 * Secrets the embedded default generates on first start so `npm start` works
 * with nothing configured: the token-encryption key, the admin key, a demo
 * tenant's key and the local agent's token. Kept in DATA_DIR/secrets.json
 * (mode 0600) so they survive restarts; an environment variable always wins.
 */
const secretsSchema = z.object({
  token_encryption_key: z.string(),
  admin_api_key: z.string(),
  demo_api_key: z.string(),
  local_agent_token: z.string(),
});
export type GeneratedSecrets = z.infer<typeof secretsSchema>;

export async function loadOrCreateSecrets(dataDir: string): Promise<GeneratedSecrets> {
  const file = join(dataDir, 'secrets.json');
  try {
    return secretsSchema.parse(JSON.parse(await readFile(file, 'utf8')));
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw new Error(`${file} is unreadable or malformed; fix or delete it: ${(err as Error).message}`);
  }
  const secrets: GeneratedSecrets = {
    token_encryption_key: randomBytes(32).toString('base64'),
    admin_api_key: `adm_${randomBytes(24).toString('base64url')}`,
    demo_api_key: `demo_${randomBytes(24).toString('base64url')}`,
    local_agent_token: randomBytes(32).toString('base64url'),
  };
  await mkdir(dataDir, { recursive: true });
  const tmp = `${file}.${process.pid}.tmp`;
  await writeFile(tmp, JSON.stringify(secrets, null, 2), { mode: 0o600 });
  await chmod(tmp, 0o600);
  await rename(tmp, file);
  return secrets;
}
