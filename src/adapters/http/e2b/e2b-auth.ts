import { createHmac, hkdfSync, timingSafeEqual } from 'node:crypto';

/** Where the E2B-compatible API lives: REST under it, envd (E2B_SANDBOX_URL) at `${E2B_PREFIX}/envd`. */
export const E2B_PREFIX = '/e2b';
export const E2B_ENVD_PREFIX = `${E2B_PREFIX}/envd`;

/** The port the SDK names in E2b-Sandbox-Port for envd. */
export const ENVD_PORT = 49983;

/**
 * What we answer as `envdVersion`. The SDK gates features on it: from 0.5.7
 * it uses closeStdin and octet-stream uploads (built here), and below 0.6.2 /
 * 0.6.3 / 0.6.4 it refuses file metadata, watch entries and network-mount
 * watches itself (not built here), so nothing is sent that would be ignored.
 */
export const ENVD_VERSION = '0.5.7';

/**
 * Per-VM envd access tokens (E2B's envdAccessToken, sent back as
 * X-Access-Token): HMAC of the VM id under a key derived from the token
 * encryption key, so nothing is stored, every replica computes the same
 * token, and a fork (a new id) never holds its source's. It grants root in
 * the sandbox: it is only ever shown to the VM's own tenant.
 */
export class EnvdTokens {
  readonly #key: Buffer;

  constructor(tokenEncryptionKey: Buffer) {
    this.#key = Buffer.from(hkdfSync('sha256', tokenEncryptionKey, Buffer.alloc(0), 'fleet e2b envd access token v1', 32));
  }

  tokenFor(vmId: string): string {
    return createHmac('sha256', this.#key).update(`envd:${vmId}`).digest('base64url');
  }

  /** Constant-time: the time taken says nothing of how close a guess came. */
  verify(vmId: string, presented: string | undefined): boolean {
    if (!presented) return false;
    const want = createHmac('sha256', this.#key).update(this.tokenFor(vmId)).digest();
    const got = createHmac('sha256', this.#key).update(presented).digest();
    return timingSafeEqual(want, got);
  }
}
