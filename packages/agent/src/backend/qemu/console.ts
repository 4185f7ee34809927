import { open, readFile, rename, writeFile, type FileHandle } from 'node:fs/promises';
import { createConnection, type Socket } from 'node:net';

/**
 * The VM's serial console, written to its log file by the agent rather than
 * by QEMU: QEMU's file chardev grows without bound, and a guest can write
 * to its serial port as fast as it likes. QEMU serves the console on a unix
 * socket (`server=on,wait=off`: output with no agent connected is dropped);
 * this reader appends it to `serial.log` and, rather than pass `maxBytes`,
 * keeps the newer half. It reconnects while the VM runs (after an agent restart the
 * new agent connects again; what the guest wrote meanwhile is lost).
 */
export class ConsoleLog {
  private sock: Socket | undefined;
  private fh: FileHandle | undefined;
  private size = 0;
  private tail: Promise<unknown> = Promise.resolve();
  private closed = false;
  private retry: NodeJS.Timeout | undefined;

  private constructor(
    private readonly socketPath: string,
    private readonly logPath: string,
    private readonly maxBytes: number,
    private readonly running: () => Promise<boolean>,
  ) {}

  static async start(opts: {
    socketPath: string;
    logPath: string;
    maxBytes: number;
    running: () => Promise<boolean>;
  }): Promise<ConsoleLog> {
    const c = new ConsoleLog(opts.socketPath, opts.logPath, opts.maxBytes, opts.running);
    c.fh = await open(opts.logPath, 'a', 0o600);
    c.size = (await c.fh.stat()).size;
    c.connect();
    return c;
  }

  private connect(): void {
    if (this.closed) return;
    const sock = createConnection({ path: this.socketPath });
    this.sock = sock;
    sock.on('data', (d: Buffer) => {
      // Serialized: a trim must not interleave with appends.
      this.tail = this.tail.then(() => this.append(d)).catch(() => undefined);
    });
    sock.on('error', () => undefined);
    sock.on('close', () => {
      if (this.closed) return;
      this.retry = setTimeout(() => {
        void this.running().then((up) => {
          if (up) this.connect();
        });
      }, 500);
      this.retry.unref();
    });
  }

  private async append(d: Buffer): Promise<void> {
    if (!this.fh) return;
    if (this.size + d.length <= this.maxBytes) {
      await this.fh.write(d);
      this.size += d.length;
      return;
    }
    // Cut before writing, into a new file renamed over the old: a reader never sees the log past its bound.
    const all = Buffer.concat([await readFile(this.logPath), d]);
    const kept = all.subarray(Math.max(0, all.length - Math.floor(this.maxBytes / 2)));
    const tmp = `${this.logPath}.tmp`;
    await writeFile(tmp, kept, { mode: 0o600 });
    await this.fh.close();
    await rename(tmp, this.logPath);
    this.fh = await open(this.logPath, 'a', 0o600);
    this.size = kept.length;
  }

  async close(): Promise<void> {
    this.closed = true;
    if (this.retry) clearTimeout(this.retry);
    this.sock?.destroy();
    await this.tail;
    await this.fh?.close();
    this.fh = undefined;
  }
}
