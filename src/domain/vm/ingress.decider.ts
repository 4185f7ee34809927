import type { Aggregate } from '../aggregate.js';
import { assertNever, type DecideContext, type Decider } from '../decider.js';
import type { RecordedEvent } from '../event-store.port.js';
import { vmStream } from './vm.aggregate.js';
import { VmInvalidStateError } from './vm.errors.js';
import { isIngressEventType, parseIngressEvent, type IngressEvent, type IngressRoute } from './ingress.events.js';
import { parseVmEvent, type VmDestroyed, type VmDestroyRequested, type VmFailed } from './vm.events.js';

/**
 * A VM's ingress routes, decided on the VM's stream (like its migrations):
 * publish once per VM (a fork is another VM, so it gets its own token),
 * adopt when the VM moves, unpublish when it ends. The VM ending is folded
 * in too, so a publish racing a destroy loses at the append.
 */
export type IngressCommand =
  | {
      readonly type: 'PublishRoutes';
      readonly data: {
        readonly vm_id: string;
        readonly tenant_id: string;
        readonly host_id: string;
        readonly routes: readonly IngressRoute[];
        readonly token_sha256: string;
        readonly token_encrypted: string;
      };
    }
  | {
      readonly type: 'AdoptRoutes';
      readonly data: {
        readonly vm_id: string;
        readonly host_id: string;
        /** The new host's endpoints; each route keeps its port and public flag, matched on name (`as`). */
        readonly targets: ReadonlyArray<{ readonly as: string; readonly target: string }>;
      };
    }
  | { readonly type: 'UnpublishRoutes'; readonly data: { readonly vm_id: string } };

export type IngressState =
  | { readonly status: 'none'; readonly vm_ended: boolean }
  | {
      readonly status: 'published';
      readonly vm_ended: boolean;
      readonly tenant_id: string;
      readonly host_id: string;
      readonly routes: readonly IngressRoute[];
      readonly token_sha256: string;
      readonly token_encrypted: string;
    }
  | { readonly status: 'unpublished'; readonly vm_ended: boolean };

export type IngressStreamEvent = IngressEvent | VmDestroyRequested | VmDestroyed | VmFailed;

const VM_END_TYPES: ReadonlySet<string> = new Set(['VmDestroyRequested', 'VmDestroyed', 'VmFailed']);

export const initialIngressState: IngressState = { status: 'none', vm_ended: false };

export function decideIngress(command: IngressCommand, state: IngressState, ctx: DecideContext): IngressEvent[] {
  const at = ctx.now.toISOString();
  const vm_id = command.data.vm_id;
  switch (command.type) {
    case 'PublishRoutes': {
      if (state.status === 'published') return [];
      if (state.vm_ended) throw new VmInvalidStateError(vm_id, 'ending', 'publish its ports');
      const d = command.data;
      return [
        {
          type: 'IngressPublished',
          data: {
            vm_id,
            tenant_id: d.tenant_id,
            host_id: d.host_id,
            routes: d.routes.map((r) => ({ ...r })),
            token_sha256: d.token_sha256,
            token_encrypted: d.token_encrypted,
            at,
          },
        },
      ];
    }
    case 'AdoptRoutes': {
      // A VM from before ingress was configured has nothing to carry over; its migration is not refused for it.
      if (state.status !== 'published' || state.vm_ended) return [];
      const { host_id, targets } = command.data;
      const byName = new Map(targets.map((t) => [t.as, t.target]));
      const routes = state.routes.flatMap((r) => {
        const target = byName.get(r.as);
        return target === undefined ? [] : [{ ...r, target }];
      });
      if (host_id === state.host_id && JSON.stringify(routes) === JSON.stringify(state.routes)) return [];
      return [{ type: 'IngressAdopted', data: { vm_id, adopt_from: { vm_id, host_id: state.host_id }, host_id, routes, at } }];
    }
    case 'UnpublishRoutes':
      return state.status === 'published' ? [{ type: 'IngressUnpublished', data: { vm_id, at } }] : [];
    default:
      return assertNever(command, 'ingress command');
  }
}

export function evolveIngress(state: IngressState, event: IngressStreamEvent): IngressState {
  switch (event.type) {
    case 'IngressPublished': {
      const { tenant_id, host_id, routes, token_sha256, token_encrypted } = event.data;
      return { status: 'published', vm_ended: state.vm_ended, tenant_id, host_id, routes, token_sha256, token_encrypted };
    }
    case 'IngressAdopted':
      return state.status === 'published' ? { ...state, host_id: event.data.host_id, routes: event.data.routes } : state;
    case 'IngressUnpublished':
      return { status: 'unpublished', vm_ended: state.vm_ended };
    case 'VmDestroyRequested':
    case 'VmDestroyed':
    case 'VmFailed':
      return { ...state, vm_ended: true };
    default:
      return assertNever(event, 'ingress event');
  }
}

export function decodeIngressStreamEvent(r: RecordedEvent): IngressStreamEvent | undefined {
  if (isIngressEventType(r.type)) return parseIngressEvent(r.type, r.data);
  if (VM_END_TYPES.has(r.type)) return parseVmEvent(r.type, r.data) as VmDestroyRequested | VmDestroyed | VmFailed;
  return undefined;
}

export const ingressDecider: Decider<IngressCommand, IngressStreamEvent, IngressState> = {
  decide: decideIngress,
  evolve: evolveIngress,
  initialState: initialIngressState,
};

export const ingressAggregate: Aggregate<IngressCommand, IngressStreamEvent, IngressState> = {
  streamName: vmStream,
  decode: decodeIngressStreamEvent,
  decider: ingressDecider,
};
