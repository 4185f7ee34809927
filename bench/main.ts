/**
 * `npm run bench -- <name> [args…]` runs bench/<name>.ts (its default export
 * takes the remaining arguments); with no name it lists the benchmarks.
 */
import { promises as fs } from 'node:fs';
import path from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));

async function available(): Promise<string[]> {
  return (await fs.readdir(here))
    .filter((f) => f.endsWith('.ts') && !f.endsWith('.d.ts') && f !== 'main.ts')
    .map((f) => f.slice(0, -3))
    .sort();
}

async function main(): Promise<number> {
  const [name, ...args] = process.argv.slice(2);
  const names = await available();
  if (!name) {
    process.stdout.write(`usage: npm run bench -- <name> [args]\navailable: ${names.join(', ') || '(none)'}\n`);
    return 0;
  }
  if (!names.includes(name)) {
    process.stderr.write(`unknown benchmark "${name}"; available: ${names.join(', ')}\n`);
    return 2;
  }
  const mod = (await import(pathToFileURL(path.join(here, `${name}.ts`)).href)) as { default?: unknown };
  if (typeof mod.default !== 'function') {
    process.stderr.write(`bench/${name}.ts has no default export (args: string[]) => Promise<void>\n`);
    return 2;
  }
  await (mod.default as (args: string[]) => Promise<void>)(args);
  return 0;
}

main().then(
  (code) => process.exit(code),
  (err: unknown) => {
    process.stderr.write(`benchmark failed: ${err instanceof Error ? (err.stack ?? err.message) : String(err)}\n`);
    process.exit(1);
  },
);
