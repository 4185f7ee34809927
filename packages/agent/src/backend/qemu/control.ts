import { randomBytes } from 'node:crypto';
import { createConnection } from 'node:net';

/**
 * The host side of the guest's control channel (image.ts CONTROL): the VM's
 * second serial port, served by QEMU on a unix socket under the agent's
 * 0700 run directory. Used once per memory restore, to hand the guest the
 * identity of the VM it now is: the state it resumes was captured under
 * another address, MAC, name and token when it is a fork or a move, and
 * under an older clock in any case.
 */

export interface GuestIdentity {
  readonly ip: string;
  readonly prefixLen: number;
  readonly gateway: string;
  readonly mac: string;
  readonly hostname: string;
  readonly token: string;
  /** Seconds since the epoch, set as the guest's wall clock. */
  readonly epochS: number;
}

const ipRe = /^\d{1,3}(\.\d{1,3}){3}$/;
const macRe = /^[0-9a-f]{2}(:[0-9a-f]{2}){5}$/;

/** The one line the guest reads: space-separated, so every field is checked to hold no space or control byte. */
export function identityLine(nonce: string, id: GuestIdentity): string {
  if (!ipRe.test(id.ip) || !ipRe.test(id.gateway)) throw new Error('bad address');
  if (!macRe.test(id.mac)) throw new Error(`bad MAC "${id.mac}"`);
  if (!/^[a-z0-9][a-z0-9-]{0,62}$/.test(id.hostname)) throw new Error(`bad hostname "${id.hostname}"`);
  if (!/^[0-9a-f]{16,128}$/.test(id.token)) throw new Error('bad token');
  if (!Number.isInteger(id.prefixLen) || id.prefixLen < 1 || id.prefixLen > 30) throw new Error('bad prefix');
  return `identity ${nonce} ${id.ip} ${id.prefixLen} ${id.gateway} ${id.mac} ${id.hostname} ${id.token} ${Math.floor(id.epochS)}\n`;
}

/**
 * Sends the identity and waits for the guest's "ok <nonce>". The guest can
 * write anything on its side of the port; the host reads at most 64 KiB
 * and looks only for its nonce, which a guest process cannot know before
 * the line is sent.
 */
export async function sendIdentity(socketPath: string, id: GuestIdentity, timeoutMs = 60_000): Promise<void> {
  const nonce = randomBytes(8).toString('hex');
  const line = identityLine(nonce, id);
  await new Promise<void>((resolve, reject) => {
    const sock = createConnection({ path: socketPath });
    let buf = '';
    let seen = 0;
    let resend: NodeJS.Timeout | undefined;
    const timer = setTimeout(() => finish(new Error(`the guest did not acknowledge its new identity within ${timeoutMs} ms`)), timeoutMs);
    const finish = (err?: Error): void => {
      clearTimeout(timer);
      if (resend) clearInterval(resend);
      sock.destroy();
      if (err) reject(err);
      else resolve();
    };
    sock.on('error', (err) => finish(err));
    sock.on('connect', () => {
      sock.write(line);
      // A guest just resumed may not be reading yet (and a tty drops what arrives before): say it again until answered.
      resend = setInterval(() => sock.write(line), 500);
    });
    sock.setEncoding('utf8');
    sock.on('data', (d: string) => {
      seen += d.length;
      buf = (buf + d).slice(-256);
      if (buf.includes(`ok ${nonce}`)) finish();
      else if (seen > 64 * 1024) finish(new Error('the guest flooded its control channel'));
    });
    sock.on('close', () => finish(new Error('the control channel closed before the guest answered')));
  });
}
