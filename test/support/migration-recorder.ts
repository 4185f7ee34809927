import type { Decider } from '../../src/domain/decider.js';
import type { MigrationEvent } from '../../src/domain/migration/migration.events.js';

type Omit_at<E> = E extends { type: infer T; data: infer D } ? { type: T; data: Omit<D, 'at'> } : never;
export type MigrationRecord = Omit_at<MigrationEvent>;

/**
 * Writes migration events as given, with no decision: what a control plane
 * that died mid-migration left behind, for tests of the reconciler. The
 * control plane itself goes through the migration decider.
 */
export const migrationRecorder: Decider<MigrationRecord, MigrationEvent, null> = {
  decide: (c, _s, ctx) => [{ ...c, data: { ...c.data, at: ctx.now.toISOString() } } as MigrationEvent],
  evolve: (s) => s,
  initialState: null,
};
