import { randomInt } from 'node:crypto';
import net from 'node:net';

/** Below Linux's default ephemeral range (32768-60999): the kernel never hands these out to a connect() or a bind(0). */
const LOW = 20_000;
const HIGH = 32_767;
const given = new Set<number>();

function bindable(port: number): Promise<number | undefined> {
  return new Promise((resolve) => {
    const server = net.createServer();
    server.once('error', () => resolve(undefined));
    server.listen(port, '127.0.0.1', () => {
      const address = server.address();
      const bound = typeof address === 'object' && address ? address.port : undefined;
      server.close(() => resolve(bound));
    });
  });
}

/**
 * A TCP port that was free a moment ago (for tests and benchmarks). Picked at random outside the ephemeral range: a
 * port the kernel chose for bind(0) could be given to someone else's connection (or bind(0)) before its user binds
 * it, which two test files running at once did. Never the same port twice from one process.
 */
export async function freePort(): Promise<number> {
  for (let i = 0; i < 64; i++) {
    const port = randomInt(LOW, HIGH + 1);
    if (given.has(port)) continue;
    if ((await bindable(port)) === port) {
      given.add(port);
      return port;
    }
  }
  const port = await bindable(0);
  if (port === undefined) throw new Error('no free TCP port on 127.0.0.1');
  return port;
}
