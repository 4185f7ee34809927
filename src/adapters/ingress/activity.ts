import type { Logger } from 'pino';

/**
 * Traffic through the ingress as idle-expiry activity, without an event per
 * request: requests and open connections (websockets, long responses) mark
 * their VM in memory, and every `flushMs` each VM marked since the last
 * flush, or still holding a connection, gets one `record` (a
 * VmActivityRecorded). The recorded time therefore trails real use by at
 * most `flushMs`, the same bound ACTIVITY_COALESCE_MS gives exec and attach,
 * which the reconciler's idle check already waits out.
 */
export class ActivityTracker {
  private readonly touched = new Set<string>();
  private readonly openCount = new Map<string, number>();
  private timer: NodeJS.Timeout | undefined;
  private flushing: Promise<void> | undefined;

  constructor(
    private readonly record: (vmId: string) => Promise<void>,
    private readonly flushMs: number,
    private readonly logger: Logger,
  ) {}

  start(): void {
    this.timer ??= setInterval(() => void this.flush(), this.flushMs);
    this.timer.unref();
  }

  /** Marks the VM used now and for as long as the returned function has not been called. */
  open(vmId: string): () => void {
    this.touched.add(vmId);
    this.openCount.set(vmId, (this.openCount.get(vmId) ?? 0) + 1);
    let closed = false;
    return () => {
      if (closed) return;
      closed = true;
      this.touched.add(vmId);
      const n = (this.openCount.get(vmId) ?? 1) - 1;
      if (n <= 0) this.openCount.delete(vmId);
      else this.openCount.set(vmId, n);
    };
  }

  /** VMs that would be recorded by a flush now. */
  pending(): string[] {
    return [...new Set([...this.touched, ...this.openCount.keys()])];
  }

  async flush(): Promise<void> {
    if (this.flushing) return this.flushing;
    const ids = this.pending();
    this.touched.clear();
    this.flushing = (async () => {
      for (const id of ids) {
        await this.record(id).catch((err: unknown) =>
          this.logger.warn({ vm_id: id, err: { message: (err as Error).message } }, 'ingress activity not recorded'),
        );
      }
    })().finally(() => (this.flushing = undefined));
    return this.flushing;
  }

  async stop(): Promise<void> {
    if (this.timer) clearInterval(this.timer);
    this.timer = undefined;
    await this.flush();
  }
}
