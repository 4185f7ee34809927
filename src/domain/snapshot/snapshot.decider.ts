import { assertNever, compact, type DecideContext, type Decider } from '../decider.js';
import { AppError, ConflictError, NotFoundError } from '@fleet/agent-protocol';
import type {
  ExportRecord,
  ExportStatus,
  SnapshotDeleteReason,
  SnapshotEvent,
  SnapshotKind,
  SnapshotMode,
  SnapshotState,
} from './snapshot.events.js';

export type RequestSnapshotData = Omit<Extract<SnapshotEvent, { type: 'SnapshotRequested' }>['data'], 'at'>;

export type SnapshotCommand =
  | { readonly type: 'RequestSnapshot'; readonly data: RequestSnapshotData }
  | {
      readonly type: 'CompleteSnapshot';
      readonly data: {
        snapshot_id: string;
        digest: string;
        size_bytes: number;
        kind: SnapshotKind;
        files?: Record<string, string> | undefined;
        pause_ms?: number | undefined;
      };
    }
  | { readonly type: 'FailSnapshot'; readonly data: { snapshot_id: string; error: string; error_code?: string | undefined } }
  | {
      readonly type: 'RecordArtifactMoved';
      readonly data: {
        snapshot_id: string;
        from_host_id: string;
        to_host_id: string;
        size_bytes: number;
        kind: SnapshotKind;
        duration_ms: number;
      };
    }
  | {
      readonly type: 'RecordArtifactMoveFailed';
      readonly data: { snapshot_id: string; from_host_id: string; to_host_id: string; error: string; error_code?: string | undefined };
    }
  | { readonly type: 'DropArtifact'; readonly data: { snapshot_id: string; host_id: string } }
  | { readonly type: 'RecordUse'; readonly data: { snapshot_id: string } }
  | { readonly type: 'DeleteSnapshot'; readonly data: { snapshot_id: string; reason: SnapshotDeleteReason; forced: boolean } }
  | { readonly type: 'RequestExport'; readonly data: { snapshot_id: string; destination: string } }
  | {
      readonly type: 'UpdateExport';
      readonly data: { snapshot_id: string; destination: string; status: ExportStatus; error?: string | undefined };
    };

export interface ExistingSnapshot {
  readonly status: SnapshotState;
  readonly snapshot_id: string;
  readonly vm_id: string;
  readonly tenant_id: string;
  readonly task_id: string | undefined;
  readonly host_id: string;
  readonly arch: string;
  readonly mode: SnapshotMode;
  readonly comment: string;
  readonly metadata: Readonly<Record<string, string>>;
  readonly retention_until: string | undefined;
  readonly parent_snapshot_id: string | undefined;
  readonly layer_key: string | undefined;
  readonly quota_counted: boolean;
  readonly digest: string | undefined;
  readonly size_bytes: number;
  readonly kind: SnapshotKind;
  readonly files: Readonly<Record<string, string>>;
  /** Hosts holding a committed copy: the origin once taken, then every move's target. */
  readonly holders: readonly string[];
  readonly exports: readonly ExportRecord[];
  readonly last_error: string | undefined;
  readonly created_at: string;
  readonly updated_at: string;
  readonly last_used_at: string;
}

export type SnapshotAggregate = { readonly status: 'initial' } | ExistingSnapshot;

export const initialSnapshotState: SnapshotAggregate = { status: 'initial' };

function existing(state: SnapshotAggregate, id: string): ExistingSnapshot {
  if (state.status === 'initial') throw new NotFoundError('SNAPSHOT_NOT_FOUND', `snapshot ${id} does not exist`, { snapshot_id: id });
  return state;
}

function invalid(s: ExistingSnapshot, what: string): AppError {
  return new ConflictError('SNAPSHOT_INVALID_STATE', `snapshot ${s.snapshot_id} is ${s.status}: cannot ${what}`, {
    snapshot_id: s.snapshot_id,
    state: s.status,
  });
}

export function decideSnapshot(command: SnapshotCommand, state: SnapshotAggregate, ctx: DecideContext): SnapshotEvent[] {
  const at = ctx.now.toISOString();
  const snapshot_id = command.data.snapshot_id;
  switch (command.type) {
    case 'RequestSnapshot': {
      if (state.status !== 'initial') throw new ConflictError('SNAPSHOT_EXISTS', `snapshot ${snapshot_id} already exists`, { snapshot_id });
      return [{ type: 'SnapshotRequested', data: compact({ ...command.data, at }) }];
    }
    case 'CompleteSnapshot': {
      const s = existing(state, snapshot_id);
      if (s.status === 'ready' && s.digest === command.data.digest) return [];
      if (s.status !== 'creating') throw invalid(s, 'complete it');
      const d = command.data;
      return [
        {
          type: 'SnapshotTaken',
          data: compact({
            snapshot_id,
            digest: d.digest,
            size_bytes: d.size_bytes,
            kind: d.kind,
            files: d.files && Object.keys(d.files).length ? d.files : undefined,
            pause_ms: d.pause_ms,
            at,
          }),
        },
      ];
    }
    case 'FailSnapshot': {
      const s = existing(state, snapshot_id);
      if (s.status === 'failed' || s.status === 'deleted') return [];
      if (s.status !== 'creating') throw invalid(s, 'fail it');
      return [
        { type: 'SnapshotFailed', data: compact({ snapshot_id, error: command.data.error, error_code: command.data.error_code, at }) },
      ];
    }
    case 'RecordArtifactMoved': {
      const s = existing(state, snapshot_id);
      if (s.status !== 'ready') throw invalid(s, 'record a copy of it');
      if (s.holders.includes(command.data.to_host_id)) return [];
      return [{ type: 'SnapshotArtifactMoved', data: { ...command.data, at } }];
    }
    case 'RecordArtifactMoveFailed': {
      existing(state, snapshot_id);
      return [{ type: 'SnapshotArtifactMoveFailed', data: compact({ ...command.data, at }) }];
    }
    case 'DropArtifact': {
      const s = existing(state, snapshot_id);
      if (!s.holders.includes(command.data.host_id)) return [];
      return [{ type: 'SnapshotArtifactDropped', data: { snapshot_id, host_id: command.data.host_id, at } }];
    }
    case 'RecordUse': {
      const s = existing(state, snapshot_id);
      if (s.status !== 'ready') throw invalid(s, 'use it');
      return [{ type: 'SnapshotUsed', data: { snapshot_id, at } }];
    }
    case 'DeleteSnapshot': {
      const s = existing(state, snapshot_id);
      if (s.status === 'deleted') return [];
      if (s.status === 'creating') throw invalid(s, 'delete it while it is being taken (wait for ready or failed)');
      return [{ type: 'SnapshotDeleted', data: { snapshot_id, reason: command.data.reason, forced: command.data.forced, at } }];
    }
    case 'RequestExport': {
      const s = existing(state, snapshot_id);
      if (s.status !== 'ready') throw invalid(s, 'export it');
      const cur = s.exports.find((e) => e.destination === command.data.destination);
      if (cur && cur.status !== 'failed') return [];
      return [{ type: 'SnapshotExportRequested', data: { snapshot_id, destination: command.data.destination, at } }];
    }
    case 'UpdateExport': {
      const s = existing(state, snapshot_id);
      const cur = s.exports.find((e) => e.destination === command.data.destination);
      if (!cur) throw new NotFoundError('EXPORT_NOT_FOUND', `snapshot ${snapshot_id} has no export to ${command.data.destination}`);
      if (cur.status === command.data.status && cur.last_error === command.data.error) return [];
      return [{ type: 'SnapshotExportUpdated', data: compact({ ...command.data, at }) }];
    }
    default:
      return assertNever(command, 'snapshot command');
  }
}

export function evolveSnapshot(state: SnapshotAggregate, event: SnapshotEvent): SnapshotAggregate {
  if (event.type === 'SnapshotRequested') {
    const d = event.data;
    return {
      status: 'creating',
      snapshot_id: d.snapshot_id,
      vm_id: d.vm_id,
      tenant_id: d.tenant_id,
      task_id: d.task_id,
      host_id: d.host_id,
      arch: d.arch,
      mode: d.mode,
      comment: d.comment,
      metadata: d.metadata,
      retention_until: d.retention_until,
      parent_snapshot_id: d.parent_snapshot_id,
      layer_key: d.layer_key,
      quota_counted: d.quota_counted,
      digest: undefined,
      size_bytes: 0,
      kind: 'disk',
      files: {},
      holders: [],
      exports: [],
      last_error: undefined,
      created_at: d.at,
      updated_at: d.at,
      last_used_at: d.at,
    };
  }
  if (state.status === 'initial') return state;
  const s = state;
  switch (event.type) {
    case 'SnapshotTaken': {
      const d = event.data;
      return {
        ...s,
        status: 'ready',
        digest: d.digest,
        size_bytes: d.size_bytes,
        kind: d.kind,
        files: d.files ?? {},
        holders: [s.host_id],
        updated_at: d.at,
        last_used_at: d.at,
      };
    }
    case 'SnapshotFailed':
      return { ...s, status: 'failed', last_error: event.data.error, updated_at: event.data.at };
    case 'SnapshotArtifactMoved':
      return {
        ...s,
        holders: s.holders.includes(event.data.to_host_id) ? s.holders : [...s.holders, event.data.to_host_id],
        updated_at: event.data.at,
      };
    case 'SnapshotArtifactMoveFailed':
      return { ...s, updated_at: event.data.at };
    case 'SnapshotArtifactDropped':
      return { ...s, holders: s.holders.filter((h) => h !== event.data.host_id), updated_at: event.data.at };
    case 'SnapshotUsed':
      return { ...s, last_used_at: event.data.at };
    case 'SnapshotDeleted':
      return { ...s, status: 'deleted', updated_at: event.data.at };
    case 'SnapshotExportRequested': {
      const d = event.data;
      const rec: ExportRecord = { destination: d.destination, status: 'pending', requested_at: d.at, updated_at: d.at };
      return { ...s, exports: [...s.exports.filter((e) => e.destination !== d.destination), rec], updated_at: d.at };
    }
    case 'SnapshotExportUpdated': {
      const d = event.data;
      return {
        ...s,
        exports: s.exports.map((e) =>
          e.destination === d.destination ? compact({ ...e, status: d.status, updated_at: d.at, last_error: d.error }) : e,
        ),
        updated_at: d.at,
      };
    }
    default:
      return assertNever(event, 'snapshot event');
  }
}

export const snapshotDecider: Decider<SnapshotCommand, SnapshotEvent, SnapshotAggregate> = {
  decide: decideSnapshot,
  evolve: evolveSnapshot,
  initialState: initialSnapshotState,
};
