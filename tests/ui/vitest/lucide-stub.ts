// No icons: see vitest.config.ts.
export {};
