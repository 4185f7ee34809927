declare module 'parse-prometheus-text-format' {
  /** Metric families as the library returns them (its own README is the reference; it ships no types). */
  export default function parsePrometheusTextFormat(text: string): unknown[];
}
