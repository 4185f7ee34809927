import { assertNever, compact, type DecideContext, type Decider } from '../decider.js';
import type { PlacementDecision } from '../placement/placement.js';
import type { EgressSpec } from '@fleet/agent-protocol';
import { toStoredSpec, type SealedSpecFields, type StoredVmSpec, type VmSpec } from './spec.js';
import { VmAlreadyExistsError, VmInvalidStateError, VmNotFoundError } from './vm.errors.js';
import type { Endpoint, VmEndReason, VmEvent, VmPhase, VmReservation } from './vm.events.js';
import { assertEndReason, type DestroyReason, type FailReason, type VmMetadata } from './vm.lifecycle.js';

// ---------------------------------------------------------------- commands

export type VmCommand =
  | {
      readonly type: 'RequestVm';
      /** `spec` as returned by validateVmSpec (the fleet limits are the command layer's to apply). */
      readonly data: {
        readonly vm_id: string;
        readonly spec: VmSpec;
        /** Ciphertexts of the spec's credential-bearing fields; a field present in `spec` without its ciphertext is refused. */
        readonly sealed?: SealedSpecFields | undefined;
        readonly tenant_id: string;
        readonly task_id?: string | undefined;
        readonly idempotency_key?: string | undefined;
      };
    }
  | {
      readonly type: 'PlaceVm';
      readonly data: {
        readonly vm_id: string;
        readonly host_id: string;
        readonly decision: PlacementDecision;
        readonly reservation: VmReservation;
      };
    }
  | { readonly type: 'StartBoot'; readonly data: { readonly vm_id: string } }
  | {
      readonly type: 'CompleteBoot';
      readonly data: {
        readonly vm_id: string;
        readonly url: string;
        readonly endpoints: readonly Endpoint[];
        readonly boot_ms: number;
        readonly auth_token_encrypted?: string | undefined;
      };
    }
  | { readonly type: 'RecordActivity'; readonly data: { readonly vm_id: string } }
  | { readonly type: 'RequestDestroy'; readonly data: { readonly vm_id: string; readonly reason: DestroyReason } }
  | { readonly type: 'ConfirmDestroyed'; readonly data: { readonly vm_id: string } }
  | {
      readonly type: 'CompleteMigration';
      readonly data: {
        readonly vm_id: string;
        readonly from_host_id: string;
        readonly host_id: string;
        readonly decision: PlacementDecision;
        readonly reservation: VmReservation;
        readonly snapshot_id: string;
        readonly url: string;
        readonly endpoints: readonly Endpoint[];
      };
    }
  | { readonly type: 'ChangeEgress'; readonly data: { readonly vm_id: string; readonly egress: EgressSpec } }
  | {
      /** Its egress provider failed to provision or tear down its endpoint (a fact to count; the VM's end is separate). */
      readonly type: 'RecordEgressFailure';
      readonly data: { readonly vm_id: string; readonly provider: string; readonly op: 'provision'; readonly error: string };
    }
  | {
      readonly type: 'RecordOomKill';
      readonly data: {
        readonly vm_id: string;
        readonly process: string;
        readonly pid?: number | undefined;
        readonly limit_mb: number;
        readonly count: number;
        /** When the host saw it (the event's `at`), not when it was recorded. */
        readonly at: string;
      };
    }
  | {
      readonly type: 'PauseVm';
      readonly data: { readonly vm_id: string; readonly checkpoint_id: string; readonly pause_ms: number };
    }
  | {
      readonly type: 'ResumeVm';
      readonly data: {
        readonly vm_id: string;
        readonly host_id: string;
        readonly decision: PlacementDecision;
        readonly reservation: VmReservation;
        readonly endpoints: readonly Endpoint[];
        readonly resume_ms: number;
      };
    }
  | {
      readonly type: 'RestoreVm';
      readonly data: {
        readonly vm_id: string;
        readonly snapshot_id: string;
        readonly kind: 'disk' | 'live';
        readonly endpoints: readonly Endpoint[];
        readonly restore_ms: number;
      };
    }
  | {
      readonly type: 'FailVm';
      readonly data: {
        readonly vm_id: string;
        readonly reason: FailReason;
        readonly error: string;
        readonly error_code?: string | undefined;
        /** For `exited` and `oom`, when the host reported it: the init's exit code, or the signal that killed it. */
        readonly exit_code?: number | undefined;
        readonly exit_signal?: string | undefined;
      };
    }
  | {
      /** PATCH: a new max runtime from now (running VMs only) and/or metadata replaced, in one append. */
      readonly type: 'UpdateVm';
      readonly data: { readonly vm_id: string; readonly timeout_s?: number | undefined; readonly metadata?: VmMetadata | undefined };
    };

// ---------------------------------------------------------------- state

interface VmCore {
  readonly vm_id: string;
  readonly tenant_id: string;
  readonly task_id: string | undefined;
  readonly idempotency_key: string | undefined;
  readonly spec: StoredVmSpec;
  readonly requested_at: string;
  /** Time of the last state change: the stuck detector's clock. */
  readonly transitioned_at: string;
  /** Last control-plane activity (request, boot, exec, attach): the idle detector's clock. */
  readonly last_activity_at: string;
  /** Set from placement on; kept through the end so the capacity can be released. */
  readonly host_id?: string | undefined;
  readonly decision?: PlacementDecision | undefined;
  readonly reservation?: VmReservation | undefined;
  readonly url?: string | undefined;
  readonly endpoints: readonly Endpoint[];
  readonly boot_ms?: number | undefined;
  readonly auth_token_encrypted?: string | undefined;
  readonly metadata: VmMetadata;
  /** When a running VM ends with reason `timeout`: boot + max_runtime_s, or a PATCHed timeout. Unset: the fleet ceiling only. */
  readonly timeout_at?: string | undefined;
  /** OOM kills recorded (VmOomKilled's count): the host's counter above it means kills not yet recorded. */
  readonly oom_kills?: number | undefined;
}

interface Placed {
  readonly host_id: string;
  readonly decision: PlacementDecision;
  readonly reservation: VmReservation;
}

interface Booted {
  readonly url: string;
  readonly boot_ms: number;
}

export type VmState =
  | { readonly status: 'initial' }
  | (VmCore & { readonly status: 'requested' })
  | (VmCore & Placed & { readonly status: 'placed' })
  | (VmCore & Placed & { readonly status: 'booting' })
  | (VmCore & Placed & Booted & { readonly status: 'running' })
  | (VmCore &
      Placed &
      Booted & {
        readonly status: 'paused';
        readonly checkpoint_id: string;
        /** How long it had run when paused: a resume counts max_runtime on from there, not from zero. */
        readonly ran_ms: number;
      })
  | (VmCore & { readonly status: 'destroying'; readonly destroy_reason: VmEndReason })
  | (VmCore & { readonly status: 'destroyed'; readonly reason: VmEndReason })
  | (VmCore & {
      readonly status: 'failed';
      readonly reason: VmEndReason;
      readonly error: string;
      readonly error_code: string | undefined;
      readonly phase: VmPhase;
      readonly exit_code?: number | undefined;
      readonly exit_signal?: string | undefined;
    });

export type ExistingVmState = Exclude<VmState, { status: 'initial' }>;

export const initialVmState: VmState = { status: 'initial' };

export function isTerminal(status: VmState['status']): status is 'destroyed' | 'failed' {
  return status === 'destroyed' || status === 'failed';
}

// ---------------------------------------------------------------- decide

function existing(state: VmState, vmId: string): ExistingVmState {
  if (state.status === 'initial') throw new VmNotFoundError(vmId);
  return state;
}

export function decideVm(command: VmCommand, state: VmState, ctx: DecideContext): VmEvent[] {
  const at = ctx.now.toISOString();
  const vm_id = command.data.vm_id;
  switch (command.type) {
    case 'RequestVm': {
      if (state.status !== 'initial') {
        // A retried create carrying the same key finds its own VM: no second one.
        if (command.data.idempotency_key !== undefined && command.data.idempotency_key === state.idempotency_key) return [];
        throw new VmAlreadyExistsError(vm_id);
      }
      const d = command.data;
      return [
        {
          type: 'VmRequested',
          data: compact({
            vm_id,
            spec: toStoredSpec(d.spec, d.sealed),
            tenant_id: d.tenant_id,
            task_id: d.task_id,
            idempotency_key: d.idempotency_key,
            metadata: d.spec.metadata && Object.keys(d.spec.metadata).length > 0 ? { ...d.spec.metadata } : undefined,
            at,
          }),
        },
      ];
    }

    case 'PlaceVm': {
      const s = existing(state, vm_id);
      if (s.status === 'placed' && s.host_id === command.data.host_id) return [];
      if (s.status !== 'requested') {
        throw new VmInvalidStateError(vm_id, s.status, 'place it', 'release the reservation just made for it');
      }
      const { host_id, decision, reservation } = command.data;
      return [{ type: 'VmPlaced', data: { vm_id, host_id, decision, reservation: compact(reservation), at } }];
    }

    case 'StartBoot': {
      const s = existing(state, vm_id);
      if (s.status === 'booting') return [];
      if (s.status !== 'placed') throw new VmInvalidStateError(vm_id, s.status, 'start booting it');
      return [{ type: 'VmBootStarted', data: { vm_id, host_id: s.host_id, at } }];
    }

    case 'CompleteBoot': {
      const s = existing(state, vm_id);
      if (s.status === 'running') return [];
      if (s.status !== 'booting') throw new VmInvalidStateError(vm_id, s.status, 'mark it booted');
      const d = command.data;
      return [
        {
          type: 'VmBooted',
          data: compact({
            vm_id,
            url: d.url,
            endpoints: [...d.endpoints],
            boot_ms: d.boot_ms,
            auth_token_encrypted: d.auth_token_encrypted,
            at,
          }),
        },
      ];
    }

    case 'RecordActivity': {
      const s = existing(state, vm_id);
      if (s.status !== 'running') throw new VmInvalidStateError(vm_id, s.status, 'record activity on it');
      if (at <= s.last_activity_at) return [];
      return [{ type: 'VmActivityRecorded', data: { vm_id, at } }];
    }

    case 'RequestDestroy': {
      const s = existing(state, vm_id);
      const reason = command.data.reason;
      assertEndReason(reason, 'destroy');
      switch (s.status) {
        case 'destroying':
        case 'destroyed':
        case 'failed':
          return [];
        case 'requested':
          // Nothing exists on a host yet: it is gone as soon as it is asked to go.
          return [
            { type: 'VmDestroyRequested', data: { vm_id, reason, at } },
            { type: 'VmDestroyed', data: { vm_id, reason, at } },
          ];
        case 'placed':
        case 'booting':
        case 'running':
        case 'paused':
          return [{ type: 'VmDestroyRequested', data: { vm_id, reason, at } }];
        default:
          return assertNever(s, 'vm state');
      }
    }

    case 'ConfirmDestroyed': {
      const s = existing(state, vm_id);
      if (s.status === 'destroyed' || s.status === 'failed') return [];
      if (s.status !== 'destroying')
        throw new VmInvalidStateError(vm_id, s.status, 'confirm it destroyed', 'request its destruction first');
      return [{ type: 'VmDestroyed', data: { vm_id, reason: s.destroy_reason, at } }];
    }

    case 'CompleteMigration': {
      const s = existing(state, vm_id);
      if (s.status === 'running' && s.host_id === command.data.host_id) return [];
      if (s.status !== 'running' || s.host_id !== command.data.from_host_id)
        throw new VmInvalidStateError(vm_id, s.status, 'complete its migration', 'it must still run on the source host');
      const d = command.data;
      return [{ type: 'VmMigrated', data: { ...d, endpoints: [...d.endpoints], reservation: compact(d.reservation), at } }];
    }

    case 'RecordOomKill': {
      const s = existing(state, vm_id);
      const d = command.data;
      if (d.count <= (s.oom_kills ?? 0)) return [];
      return [
        {
          type: 'VmOomKilled',
          data: compact({ vm_id, process: d.process, pid: d.pid, limit_mb: d.limit_mb, count: d.count, at: d.at }),
        },
      ];
    }

    case 'RecordEgressFailure': {
      existing(state, vm_id);
      const d = command.data;
      return [{ type: 'VmEgressFailed', data: { vm_id, provider: d.provider, op: d.op, error: d.error.slice(0, 2000), at } }];
    }

    case 'PauseVm': {
      const s = existing(state, vm_id);
      if (s.status === 'paused') return [];
      if (s.status !== 'running') throw new VmInvalidStateError(vm_id, s.status, 'pause it', 'only a running VM can be paused');
      const d = command.data;
      return [{ type: 'VmPaused', data: { vm_id, host_id: s.host_id, checkpoint_id: d.checkpoint_id, pause_ms: d.pause_ms, at } }];
    }

    case 'ResumeVm': {
      const s = existing(state, vm_id);
      if (s.status === 'running') return [];
      if (s.status !== 'paused') throw new VmInvalidStateError(vm_id, s.status, 'resume it', 'only a paused VM can be resumed');
      const d = command.data;
      return [
        {
          type: 'VmResumed',
          data: {
            vm_id,
            host_id: d.host_id,
            decision: d.decision,
            reservation: compact(d.reservation),
            endpoints: [...d.endpoints],
            resume_ms: d.resume_ms,
            at,
          },
        },
      ];
    }

    case 'ChangeEgress': {
      const s = existing(state, vm_id);
      if (s.status !== 'running') throw new VmInvalidStateError(vm_id, s.status, 'change its network policy', 'it must be running');
      if (JSON.stringify(s.spec.egress) === JSON.stringify(command.data.egress)) return [];
      return [{ type: 'VmEgressChanged', data: { vm_id, egress: command.data.egress, at } }];
    }

    case 'RestoreVm': {
      const s = existing(state, vm_id);
      if (s.status !== 'running') throw new VmInvalidStateError(vm_id, s.status, 'restore it', 'only a running VM can be restored');
      const d = command.data;
      return [
        {
          type: 'VmRestored',
          data: { vm_id, snapshot_id: d.snapshot_id, kind: d.kind, endpoints: [...d.endpoints], restore_ms: d.restore_ms, at },
        },
      ];
    }

    case 'FailVm': {
      const s = existing(state, vm_id);
      // A late failure report for a VM that already ended changes nothing.
      if (isTerminal(s.status)) return [];
      const phase = s.status;
      const d = command.data;
      assertEndReason(d.reason, 'fail', d);
      return [
        {
          type: 'VmFailed',
          data: compact({
            vm_id,
            reason: d.reason,
            error: d.error,
            error_code: d.error_code,
            phase,
            exit_code: d.exit_code,
            exit_signal: d.exit_signal,
            at,
          }),
        },
      ];
    }

    case 'UpdateVm': {
      const s = existing(state, vm_id);
      const d = command.data;
      const out: VmEvent[] = [];
      if (d.timeout_s !== undefined) {
        // A deadline only means something while it runs: before, boot has not started its clock; after, it is over.
        if (s.status !== 'running') throw new VmInvalidStateError(vm_id, s.status, 'set its timeout', 'a timeout is set on a running VM');
        const timeout_at = new Date(ctx.now.getTime() + d.timeout_s * 1000).toISOString();
        out.push({ type: 'VmTimeoutSet', data: { vm_id, timeout_s: d.timeout_s, timeout_at, at } });
      }
      if (d.metadata !== undefined && !sameMetadata(d.metadata, s.metadata))
        out.push({ type: 'VmMetadataSet', data: { vm_id, metadata: { ...d.metadata }, at } });
      return out;
    }

    default:
      return assertNever(command, 'vm command');
  }
}

// ---------------------------------------------------------------- evolve

export function evolveVm(state: VmState, event: VmEvent): VmState {
  if (event.type === 'VmRequested') {
    const d = event.data;
    return {
      status: 'requested',
      vm_id: d.vm_id,
      tenant_id: d.tenant_id,
      task_id: d.task_id,
      idempotency_key: d.idempotency_key,
      spec: d.spec,
      requested_at: d.at,
      transitioned_at: d.at,
      last_activity_at: d.at,
      endpoints: [],
      metadata: d.metadata ?? {},
    };
  }
  if (state.status === 'initial') return state;
  const core: VmCore = state;
  switch (event.type) {
    case 'VmPlaced': {
      const { host_id, decision, reservation, at } = event.data;
      return { ...core, status: 'placed', host_id, decision, reservation, transitioned_at: at };
    }
    case 'VmBootStarted':
      if (state.status !== 'placed') return state;
      return { ...state, status: 'booting', transitioned_at: event.data.at };
    case 'VmBooted': {
      if (state.status !== 'booting') return state;
      const d = event.data;
      return {
        ...state,
        status: 'running',
        url: d.url,
        endpoints: d.endpoints,
        boot_ms: d.boot_ms,
        auth_token_encrypted: d.auth_token_encrypted,
        transitioned_at: d.at,
        last_activity_at: d.at,
        timeout_at: state.spec.max_runtime_s ? new Date(Date.parse(d.at) + state.spec.max_runtime_s * 1000).toISOString() : undefined,
      };
    }
    case 'VmActivityRecorded':
      return { ...state, last_activity_at: event.data.at };
    case 'VmDestroyRequested':
      return { ...core, status: 'destroying', destroy_reason: event.data.reason, transitioned_at: event.data.at };
    case 'VmDestroyed':
      return { ...core, status: 'destroyed', reason: event.data.reason, transitioned_at: event.data.at };
    case 'VmMigrated': {
      if (state.status !== 'running') return state;
      const d = event.data;
      return {
        ...state,
        host_id: d.host_id,
        decision: d.decision,
        reservation: d.reservation,
        url: d.url,
        endpoints: d.endpoints,
        last_activity_at: d.at,
      };
    }
    case 'VmOomKilled':
      return { ...state, oom_kills: Math.max(state.oom_kills ?? 0, event.data.count) };
    case 'VmEgressChanged':
      return { ...state, spec: { ...state.spec, egress: event.data.egress } };
    case 'VmEgressFailed':
      return state;
    case 'VmPaused':
      if (state.status !== 'running') return state;
      return {
        ...state,
        status: 'paused',
        checkpoint_id: event.data.checkpoint_id,
        ran_ms: Math.max(0, Date.parse(event.data.at) - Date.parse(state.transitioned_at)),
        transitioned_at: event.data.at,
      };
    case 'VmResumed': {
      if (state.status !== 'paused') return state;
      const d = event.data;
      const { checkpoint_id: _gone, ran_ms, ...rest } = state;
      return {
        ...rest,
        status: 'running',
        host_id: d.host_id,
        decision: d.decision,
        reservation: d.reservation,
        endpoints: d.endpoints,
        // The running clock (max_runtime) goes on from where the pause stopped it.
        transitioned_at: new Date(Date.parse(d.at) - ran_ms).toISOString(),
        // A deadline (PATCH timeout_s or max_runtime) moves by the time spent paused.
        timeout_at: state.timeout_at
          ? new Date(Date.parse(state.timeout_at) + Math.max(0, Date.parse(d.at) - Date.parse(state.transitioned_at))).toISOString()
          : undefined,
        last_activity_at: d.at,
      };
    }
    case 'VmRestored':
      if (state.status !== 'running') return state;
      return { ...state, endpoints: event.data.endpoints, last_activity_at: event.data.at };
    case 'VmFailed': {
      const d = event.data;
      return {
        ...core,
        status: 'failed',
        reason: d.reason,
        error: d.error,
        error_code: d.error_code,
        phase: d.phase,
        exit_code: d.exit_code,
        exit_signal: d.exit_signal,
        transitioned_at: d.at,
      };
    }
    case 'VmTimeoutSet':
      if (state.status !== 'running') return state;
      return { ...state, timeout_at: event.data.timeout_at };
    case 'VmMetadataSet':
      return { ...state, metadata: event.data.metadata };
    default:
      return assertNever(event, 'vm event');
  }
}

function sameMetadata(a: VmMetadata, b: VmMetadata): boolean {
  const ka = Object.keys(a);
  return ka.length === Object.keys(b).length && ka.every((k) => b[k] === a[k]);
}

export const vmDecider: Decider<VmCommand, VmEvent, VmState> = {
  decide: decideVm,
  evolve: evolveVm,
  initialState: initialVmState,
};
