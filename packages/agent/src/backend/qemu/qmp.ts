import { createConnection } from 'node:net';

/**
 * One QMP exchange over a VM's unix socket: greeting, qmp_capabilities,
 * then `command`. QEMU accepts one QMP client at a time per socket, so each
 * call connects, asks and disconnects.
 */
export function qmp(socketPath: string, command: string, args?: Record<string, unknown>, timeoutMs = 5_000): Promise<unknown> {
  return new Promise((resolve, reject) => {
    const sock = createConnection({ path: socketPath });
    let buf = '';
    let stage: 'greeting' | 'caps' | 'cmd' = 'greeting';
    const timer = setTimeout(() => {
      sock.destroy();
      reject(new Error(`QMP ${command} on ${socketPath} timed out`));
    }, timeoutMs);
    const done = (err: Error | null, value?: unknown): void => {
      clearTimeout(timer);
      sock.destroy();
      if (err) reject(err);
      else resolve(value);
    };
    sock.on('error', (err) => done(err));
    sock.on('close', () => done(new Error(`QMP socket ${socketPath} closed during ${command}`)));
    sock.setEncoding('utf8');
    sock.on('data', (chunk: string) => {
      buf += chunk;
      let nl: number;
      while ((nl = buf.indexOf('\n')) >= 0) {
        const line = buf.slice(0, nl).trim();
        buf = buf.slice(nl + 1);
        if (!line) continue;
        let msg: { QMP?: unknown; return?: unknown; error?: { desc?: string }; event?: string };
        try {
          msg = JSON.parse(line) as typeof msg;
        } catch {
          done(new Error(`QMP sent a line that is not JSON: ${line.slice(0, 100)}`));
          return;
        }
        if (msg.event) continue;
        if (stage === 'greeting' && msg.QMP) {
          stage = 'caps';
          sock.write(`${JSON.stringify({ execute: 'qmp_capabilities' })}\n`);
        } else if (stage === 'caps' && 'return' in msg) {
          stage = 'cmd';
          sock.write(`${JSON.stringify({ execute: command, ...(args ? { arguments: args } : {}) })}\n`);
        } else if (msg.error) {
          done(new Error(`QMP ${command}: ${msg.error.desc ?? 'error'}`));
        } else if (stage === 'cmd' && 'return' in msg) {
          done(null, msg.return);
        }
      }
    });
  });
}
