import { type ServerFrame } from '@fleet/agent-protocol';

/**
 * A push-based async iterable of frames with an error/end state, and flow control: above HIGH frames
 * waiting the source is paused, at LOW it is resumed; HARD_CAP (frames that still arrived while paused)
 * refuses more.
 */
export class FrameQueue implements AsyncIterable<ServerFrame> {
  static readonly HIGH = 32;
  static readonly LOW = 8;
  static readonly HARD_CAP = 1024;
  #items: ServerFrame[] = [];
  #waiters: Array<{ resolve: (r: IteratorResult<ServerFrame>) => void; reject: (e: unknown) => void }> = [];
  #error: Error | undefined;
  #paused = false;
  ended = false;

  constructor(private readonly source: { pause(): void; resume(): void }) {}

  /** False when the queue is over its hard cap (the frame is dropped). */
  push(frame: ServerFrame): boolean {
    if (this.ended) return true;
    const w = this.#waiters.shift();
    if (w) {
      w.resolve({ value: frame, done: false });
      return true;
    }
    if (this.#items.length >= FrameQueue.HARD_CAP) return false;
    this.#items.push(frame);
    if (!this.#paused && this.#items.length >= FrameQueue.HIGH) {
      this.#paused = true;
      this.source.pause();
    }
    return true;
  }

  #taken(): void {
    if (this.#paused && this.#items.length <= FrameQueue.LOW) {
      this.#paused = false;
      this.source.resume();
    }
  }

  end(): void {
    if (this.ended) return;
    this.ended = true;
    for (const w of this.#waiters.splice(0)) w.resolve({ value: undefined, done: true });
  }

  fail(err: Error): void {
    if (this.ended) return;
    this.#error = err;
    this.ended = true;
    for (const w of this.#waiters.splice(0)) w.reject(err);
  }

  [Symbol.asyncIterator](): AsyncIterator<ServerFrame> {
    return {
      next: () => {
        const item = this.#items.shift();
        if (item) {
          this.#taken();
          return Promise.resolve({ value: item, done: false });
        }
        if (this.#error !== undefined) {
          const err = this.#error;
          this.#error = undefined;
          return Promise.reject(err);
        }
        if (this.ended) return Promise.resolve({ value: undefined, done: true });
        return new Promise((resolve, reject) => this.#waiters.push({ resolve, reject }));
      },
      return: () => Promise.resolve({ value: undefined, done: true }),
    };
  }
}
