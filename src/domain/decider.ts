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
