#!/usr/bin/env node
// Starts the host agent (src/main.ts) through tsx, passing arguments,
// environment and signals through, and exiting with the agent's status.
// tsx is resolved from this package, so the bin works from any directory.
import { spawn } from 'node:child_process';
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const require = createRequire(import.meta.url);
let tsx;
try {
  tsx = require.resolve('tsx');
} catch {
  process.stderr.write('fleet-agent: the tsx package is missing; run `npm ci` in ' + root + '\n');
  process.exit(1);
}
const child = spawn(process.execPath, ['--import', pathToFileURL(tsx).href, join(root, 'src/main.ts'), ...process.argv.slice(2)], {
  stdio: 'inherit',
  cwd: process.cwd(),
  env: process.env,
});
for (const sig of ['SIGTERM', 'SIGINT', 'SIGHUP']) process.on(sig, () => child.kill(sig));
child.on('exit', (code, signal) => {
  if (signal) process.kill(process.pid, signal);
  else process.exit(code ?? 1);
});
