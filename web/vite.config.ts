import { fileURLToPath } from "node:url";
import { defineConfig } from "vite";

// The page is built into web/dist, which `leasehold serve` serves at `/`.
// It imports the generated service descriptors from ../src/gen, outside this
// folder, so the dev server is allowed to read the repository root.
const root = fileURLToPath(new URL(".", import.meta.url));

export default defineConfig({
  root,
  base: "/",
  build: {
    outDir: "dist",
    emptyOutDir: true,
    target: "es2022",
    sourcemap: true,
  },
  server: {
    fs: { allow: [fileURLToPath(new URL("..", import.meta.url))] },
    // `npm run dev:web` proxies the RPCs to a server started with `npm start`.
    proxy: { "/leasehold.v1.LeaseService": "http://127.0.0.1:7070" },
  },
});
