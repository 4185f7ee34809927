/**
 * A second reporter for `npm test` (scripts/run-tests.ts): each test file's wall time, start-up and teardown
 * included, slowest first, when its lane ends. Files run one at a time within a lane, but the runner announces
 * tests of later files early, so only results count: a file's time runs from the previous file's last result to
 * its own last one. CI's limit is on the whole run: this says where it goes.
 */
export default async function* fileTimes(source) {
  const started = Date.now();
  const last = new Map();
  for await (const event of source) {
    if (event.type !== 'test:pass' && event.type !== 'test:fail') continue;
    const file = event.data?.file;
    if (typeof file === 'string') last.set(file, Date.now());
  }
  let mark = started;
  const rows = [...last]
    .sort((a, b) => a[1] - b[1])
    .map(([file, end]) => {
      const row = { file: file.replace(`${process.cwd()}/`, ''), s: (end - mark) / 1000 };
      mark = end;
      return row;
    });
  rows.sort((a, b) => b.s - a.s);
  const total = rows.reduce((t, r) => t + r.s, 0);
  yield `# file times (${rows.length} files, ${total.toFixed(0)} s):\n`;
  for (const r of rows) yield `#   ${r.s.toFixed(1).padStart(7)} s  ${r.file}\n`;
}
