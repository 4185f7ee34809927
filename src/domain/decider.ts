/**
 * The shape every aggregate follows (STYLE.md, after emmett): commands in,
 * events out, state folded from events. Deciders are pure: the clock comes in
 * through `ctx`, ids inside the command.
 */

export interface DecideContext {
  readonly now: Date;
}

export interface Decider<C, E, S> {
  /** Returns the events the command produces; an empty array means "already so" (idempotent retry). Throws typed AppErrors. */
  readonly decide: (command: C, state: S, ctx: DecideContext) => E[];
  readonly evolve: (state: S, event: E) => S;
  readonly initialState: S;
}

/** Folds a stream's events into state, starting from the decider's initial state. */
export function fold<C, E, S>(decider: Decider<C, E, S>, events: Iterable<E>, from: S = decider.initialState): S {
  let state = from;
  for (const event of events) state = decider.evolve(state, event);
  return state;
}

/** Ends a switch over a union: adding a variant without handling it fails to compile. */
export function assertNever(value: never, what = 'value'): never {
  throw new Error(`unhandled ${what}: ${JSON.stringify(value)}`);
}

/**
 * Drops undefined properties, so a decided event deep-equals the same event
 * read back from the store (JSON has no undefined).
 */
export function compact<T extends object>(value: T): T {
  const out = {} as T;
  for (const key of Object.keys(value) as Array<keyof T>) if (value[key] !== undefined) out[key] = value[key];
  return out;
}
