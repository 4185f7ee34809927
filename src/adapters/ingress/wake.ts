import { AppError } from '@fleet/agent-protocol';

/** Resumes a paused VM for the ingress: the in-process control plane passes its VmMemory.resume. */
export type WakeVm = (vmId: string, tenantId: string) => Promise<void>;

/**
 * The first requests to a paused VM hold here until it runs: concurrent
 * callers share one resume (one flight per VM), and each waits at most
 * `timeoutMs` (the resume itself goes on; a later request joins it).
 */
export class Waker {
  private readonly flights = new Map<string, Promise<void>>();

  constructor(
    private readonly wake: WakeVm,
    private readonly timeoutMs: number,
  ) {}

  async untilRunning(vmId: string, tenantId: string): Promise<void> {
    let flight = this.flights.get(vmId);
    if (!flight) {
      flight = this.wake(vmId, tenantId).finally(() => this.flights.delete(vmId));
      this.flights.set(vmId, flight);
    }
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<never>((_resolve, reject) => {
      timer = setTimeout(
        () =>
          reject(new AppError('INGRESS_RESUME_TIMEOUT', 504, `sandbox ${vmId} was paused and did not resume within ${this.timeoutMs} ms`)),
        this.timeoutMs,
      );
    });
    try {
      await Promise.race([
        flight.catch((err: unknown) => {
          const code = err instanceof AppError ? err.code : 'INTERNAL';
          throw new AppError(
            'INGRESS_RESUME_FAILED',
            502,
            `sandbox ${vmId} was paused and could not be resumed (${code}): ${(err as Error).message}`,
          );
        }),
        timeout,
      ]);
    } finally {
      clearTimeout(timer);
    }
  }

  /** Resumes in flight now (tests and metrics). */
  get inFlight(): number {
    return this.flights.size;
  }
}
