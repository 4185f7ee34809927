/**
 * Runs the calls given one key one at a time, in order, within this process:
 * writers of one stream here would only collide with each other (other
 * processes still lose a revision conflict and retry). A failed call does not
 * stop the ones queued behind it. Keys with nothing queued take no memory.
 */
export class KeyedQueue {
  private readonly tails = new Map<string, Promise<void>>();

  async run<T>(key: string, fn: () => Promise<T>): Promise<T> {
    const prev = this.tails.get(key) ?? Promise.resolve();
    const run = prev.then(fn, fn);
    const tail = run.then(
      () => undefined,
      () => undefined,
    );
    this.tails.set(key, tail);
    try {
      return await run;
    } finally {
      if (this.tails.get(key) === tail) this.tails.delete(key);
    }
  }
}
