import { AppError } from '@fleet/agent-protocol';
import { snapshotAggregate } from '../../domain/snapshot/snapshot.aggregate.js';
import type { SnapshotAggregate, SnapshotCommand } from '../../domain/snapshot/snapshot.decider.js';
import { bindAggregate, type BoundOf, type CommandHandler, type CommandMeta, type Loaded } from '../command-handler.js';
import type { SnapshotResult } from './snapshot-types.js';

/** The snapshot stream (`snapshot-<id>`) through its bound handler. */
export class SnapshotStream {
  private readonly snapshotHandler: BoundOf<typeof snapshotAggregate>;

  constructor(handler: CommandHandler) {
    this.snapshotHandler = bindAggregate(handler, snapshotAggregate);
  }

  async load(snapshotId: string): Promise<Loaded<SnapshotAggregate>> {
    return this.snapshotHandler.load(snapshotId);
  }

  async run(snapshotId: string, command: SnapshotCommand, meta: CommandMeta): Promise<SnapshotResult> {
    const r = await this.snapshotHandler.handle(snapshotId, command, meta);
    if (r.state.status === 'initial') throw new AppError('INTERNAL', 500, `snapshot ${snapshotId} has no state after ${command.type}`);
    return { snapshot: r.state, position: r.position };
  }
}
