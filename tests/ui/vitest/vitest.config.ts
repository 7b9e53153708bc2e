// The UI patch's unit tests alone, in node. The UI's own config also sets up its browser and
// Storybook projects (Playwright, Chromium, PWA and Tailwind plugins) that these tests never use.
import { sveltekit } from '@sveltejs/kit/vite';
import { fileURLToPath } from 'node:url';
import { defineConfig } from 'vitest/config';

export default defineConfig({
	plugins: [sveltekit()],
	resolve: {
		alias: [
			// The chat service reaches the icon set's barrel through $lib/constants, and vite would
			// compile all of its 3,700 Svelte components (three quarters of the run) for tests that
			// render none. The stand-in exports no icon: a constant that names one holds undefined.
			{
				find: /^@lucide\/svelte$/,
				replacement: fileURLToPath(new URL('./lucide-stub.ts', import.meta.url))
			}
		]
	},
	test: { environment: 'node', include: ['tests/unit/**/*.test.ts'] }
});
