import assert from 'node:assert/strict';
import { fold, type Decider } from '../../src/domain/decider.js';
import { AppError } from '@fleet/agent-protocol';

export const T0 = new Date('2026-01-01T00:00:00.000Z');
export const at = (seconds: number): Date => new Date(T0.getTime() + seconds * 1000);

/** Given(events) / When(command) / Then(events | error code) over a pure decider. */
export function given<C, E, S>(decider: Decider<C, E, S>, events: readonly E[] = []) {
  const state = fold(decider, events);
  return {
    state,
    when(command: C, now: Date = T0) {
      const run = (): E[] => decider.decide(command, state, { now });
      return {
        then(expected: readonly E[]): E[] {
          const got = run();
          assert.deepEqual(got, expected);
          return got;
        },
        /** The events, for assertions of their own. */
        events(): E[] {
          return run();
        },
        thenThrows(code: string, status?: number, message?: RegExp): AppError {
          let caught: unknown;
          try {
            run();
          } catch (e) {
            caught = e;
          }
          // eslint-disable-next-line @typescript-eslint/no-base-to-string -- whatever was thrown, printed as JavaScript prints it
          assert.ok(caught instanceof AppError, `expected an AppError ${code}, got ${caught === undefined ? 'no error' : String(caught)}`);
          assert.equal(caught.code, code, caught.message);
          if (status !== undefined) assert.equal(caught.status, status);
          if (message) assert.match(caught.message, message);
          return caught;
        },
        /** The state after applying the produced events. */
        thenState(): S {
          return fold(decider, run(), state);
        },
      };
    },
  };
}
