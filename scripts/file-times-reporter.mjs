/**
 * A second reporter for `npm test` (scripts/run-tests.ts): each test file's wall time, start-up and teardown
 * included, slowest first, when its lane ends. Files run one at a time within a lane, so a file's time runs from
 * the previous file's last event to its own last one. CI's limit is on the whole run: this says where it goes.
 */
export default async function* fileTimes(source) {
  const spans = new Map();
  let mark = Date.now();
  let current;
  for await (const event of source) {
    const file = event.data?.file;
    if (typeof file !== 'string') continue;
    const now = Date.now();
    if (file !== current) {
      if (!spans.has(file)) spans.set(file, { start: mark, end: now });
      current = file;
    }
    spans.get(file).end = now;
    mark = now;
  }
  const rows = [...spans].map(([file, s]) => ({ file: file.replace(`${process.cwd()}/`, ''), s: (s.end - s.start) / 1000 }));
  rows.sort((a, b) => b.s - a.s);
  const total = rows.reduce((t, r) => t + r.s, 0);
  yield `# file times (${rows.length} files, ${total.toFixed(0)} s):\n`;
  for (const r of rows) yield `#   ${r.s.toFixed(1).padStart(7)} s  ${r.file}\n`;
}
