import { AppError, ConflictError, NotFoundError } from '@fleet/agent-protocol';
import { classifyHostAgentError } from '../../domain/host-agent.port.js';
import type { ExistingSnapshot } from '../../domain/snapshot/snapshot.decider.js';
import type { CommandMeta } from '../command-handler.js';
import type { HostCommands } from '../host/host-commands.js';
import type { SnapshotStream } from './snapshot-stream.js';
import type { SnapshotConfig } from './snapshot-types.js';

/** Copies of a snapshot's artifact between hosts: a grant on a holder, a verified pull on the target, an event either way. */
export class ArtifactMoves {
  constructor(
    private readonly stream: SnapshotStream,
    private readonly hosts: HostCommands,
    private readonly config: SnapshotConfig,
  ) {}

  async move(s: ExistingSnapshot, toHostId: string, meta: CommandMeta): Promise<void> {
    const fromHostId = s.holders[0];
    if (!fromHostId)
      throw new ConflictError('SNAPSHOT_NOT_HELD', `no host holds snapshot ${s.snapshot_id}`, { snapshot_id: s.snapshot_id });
    if (!s.digest || !/^[0-9a-f]{64}$/.test(s.digest)) {
      throw new ConflictError(
        'ARTIFACT_DIGEST_UNKNOWN',
        `snapshot ${s.snapshot_id} has no recorded digest, so a copy could not be verified: it stays on ${fromHostId}`,
        { snapshot_id: s.snapshot_id },
      );
    }
    const started = Date.now();
    try {
      const { state: from } = await this.hosts.load(fromHostId);
      if (from.status === 'unregistered') throw new NotFoundError('HOST_NOT_FOUND', `host ${fromHostId} is not registered`);
      const src = this.hosts.agentForState(from);
      const dst = await this.hosts.agentFor(toHostId);
      const timeoutMs = this.config.pullTimeoutMs > 0 ? this.config.pullTimeoutMs : undefined;
      const ttl = Math.max(60, Math.ceil((timeoutMs ?? 300_000) / 1000) + 30);
      const grant = await src.grantArtifact(s.snapshot_id, Math.min(3600, ttl));
      const moved = await dst.pullArtifact(
        {
          snapshot_id: s.snapshot_id,
          digest: s.digest,
          from: { url: from.url, grant: grant.grant, host_id: fromHostId },
          files: { ...s.files },
        },
        timeoutMs !== undefined ? { timeoutMs } : {},
      );
      await this.stream.run(
        s.snapshot_id,
        {
          type: 'RecordArtifactMoved',
          data: {
            snapshot_id: s.snapshot_id,
            from_host_id: fromHostId,
            to_host_id: toHostId,
            size_bytes: moved.size_bytes,
            kind: moved.kind,
            duration_ms: Date.now() - started,
          },
        },
        meta,
      );
    } catch (err) {
      const e = err instanceof AppError ? err : undefined;
      await this.stream
        .run(
          s.snapshot_id,
          {
            type: 'RecordArtifactMoveFailed',
            data: {
              snapshot_id: s.snapshot_id,
              from_host_id: fromHostId,
              to_host_id: toHostId,
              error: (err as Error).message,
              error_code: e?.code,
            },
          },
          meta,
        )
        .catch(() => undefined);
      const timedOut = e?.code === 'HOST_UNREACHABLE' && typeof e.details?.timeout_ms === 'number';
      throw new AppError(
        timedOut ? 'ARTIFACT_PULL_TIMEOUT' : 'ARTIFACT_MOVE_FAILED',
        timedOut ? 504 : classifyHostAgentError(err) === 'host' ? 502 : (e?.status ?? 502),
        `moving snapshot ${s.snapshot_id} from ${fromHostId} to ${toHostId} failed${timedOut ? ` (ARTIFACT_PULL_TIMEOUT_MS=${this.config.pullTimeoutMs})` : ''}: ${(err as Error).message}`,
        { snapshot_id: s.snapshot_id, from_host_id: fromHostId, to_host_id: toHostId, cause_code: e?.code },
        { cause: err },
      );
    }
  }
}
