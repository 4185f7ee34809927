/** What the control plane and the host agent share: the wire protocol, host capacity and the typed errors whose codes both send. */
export * from './agent-protocol.js';
export * from './capacity.js';
export * from './errors.js';
export * from './observe-protocol.js';
export * from './egress.js';
export * from './migration.js';
