/** Resolves or rejects as `p` does, or rejects with "no answer within N ms" first. The timer never outlives the race. */
export async function withTimeout<T>(p: Promise<T>, ms: number): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([
      p,
      new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`no answer within ${ms} ms`)), ms))),
    ]);
  } finally {
    if (timer) clearTimeout(timer);
  }
}
