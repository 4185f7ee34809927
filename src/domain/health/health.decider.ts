import type { DecideContext, Decider } from '../decider.js';
import type { HealthEvent, HealthState } from './health.events.js';

export type HealthCommand = {
  readonly type: 'RecordHealthVerdict';
  readonly data: { readonly vm_id: string; readonly state: HealthState; readonly failures: number; readonly message: string };
};

export type VmHealthState =
  | { readonly status: 'unknown' }
  | { readonly status: HealthState; readonly since: string; readonly failures: number; readonly message: string };

export const initialVmHealthState: VmHealthState = { status: 'unknown' };

/** Records a verdict only when the state changes (failures counting up inside `unhealthy` is not a change). */
export function decideHealth(command: HealthCommand, state: VmHealthState, ctx: DecideContext): HealthEvent[] {
  const d = command.data;
  if (state.status === d.state) return [];
  return [
    {
      type: 'VmHealthChanged',
      data: { vm_id: d.vm_id, state: d.state, since: ctx.now.toISOString(), failures: d.failures, message: d.message.slice(0, 2000) },
    },
  ];
}

export function evolveHealth(_state: VmHealthState, event: HealthEvent): VmHealthState {
  const d = event.data;
  return { status: d.state, since: d.since, failures: d.failures, message: d.message };
}

export const healthDecider: Decider<HealthCommand, HealthEvent, VmHealthState> = {
  decide: decideHealth,
  evolve: evolveHealth,
  initialState: initialVmHealthState,
};

export interface HealthcheckSpec {
  readonly interval_seconds?: number | undefined;
  readonly timeout_seconds?: number | undefined;
  readonly retries?: number | undefined;
  readonly start_period_seconds?: number | undefined;
}

export const HEALTH_DEFAULTS = { interval_seconds: 30, timeout_seconds: 5, retries: 3, start_period_seconds: 0 } as const;

/**
 * The verdict after one attempt (docker's rules): a pass is healthy at once;
 * failures inside the start period keep it `starting`; after it, more than
 * `retries` consecutive failures make it `unhealthy`, fewer keep the previous
 * verdict (or `starting` before the first).
 */
export function nextHealth(
  previous: HealthState | 'unknown',
  passed: boolean,
  failures: number,
  spec: HealthcheckSpec,
  sinceBootMs: number,
): HealthState {
  if (passed) return 'healthy';
  const startPeriodMs = (spec.start_period_seconds ?? HEALTH_DEFAULTS.start_period_seconds) * 1000;
  if (sinceBootMs < startPeriodMs) return previous === 'unknown' ? 'starting' : previous;
  if (failures > (spec.retries ?? HEALTH_DEFAULTS.retries)) return 'unhealthy';
  return previous === 'unknown' ? 'starting' : previous;
}
