// Serves the built web page (web/dist) for every path that is not an RPC.
// The folder holds a few small files, so each request reads its file whole;
// nothing is cached in memory, and a rebuild is served without a restart.

import { readFile, stat } from "node:fs/promises";
import type http from "node:http";
import path from "node:path";

// The parts of Node's HTTP/1.1 and HTTP/2 compatibility objects used here.
interface Request {
  readonly method?: string | undefined;
  readonly url?: string | undefined;
  readonly headers: http.IncomingHttpHeaders;
}
interface Response {
  readonly headersSent: boolean;
  setHeader(name: string, value: string): unknown;
  writeHead(status: number, headers?: http.OutgoingHttpHeaders): unknown;
  end(data?: string | Uint8Array): unknown;
}

/** Where `npm run build:web` puts the page, relative to this package. */

const contentTypes: Record<string, string> = {
  ".html": "text/html; charset=utf-8",
  ".js": "text/javascript; charset=utf-8",
  ".mjs": "text/javascript; charset=utf-8",
  ".css": "text/css; charset=utf-8",
  ".map": "application/json; charset=utf-8",
  ".json": "application/json; charset=utf-8",
  ".svg": "image/svg+xml",
  ".png": "image/png",
  ".ico": "image/x-icon",
  ".woff2": "font/woff2",
  ".txt": "text/plain; charset=utf-8",
};

// Vite names every file under assets/ after a hash of its content, so a
// browser may keep them forever; index.html names the current ones and is
// revalidated on every load.
const hashedPrefix = "/assets/";
const immutable = "public, max-age=31536000, immutable";

// The page talks only to its own origin. Inline scripts and styles are not
// needed (Vite emits files), so none are allowed.
const pageHeaders = {
  "content-security-policy":
    "default-src 'self'; connect-src 'self'; img-src 'self' data:; object-src 'none'; " +
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
  "x-content-type-options": "nosniff",
  "referrer-policy": "no-referrer",
};

const notBuilt =
  "The web page is not built. Run `npm run build:web` (npm start and npm test build it first).\n";

export interface StaticHandlerOptions {
  /** Folder of the built page (config's defaultWebDir unless configured). */
  root: string;
  /** Called with unexpected file system errors (answered 500). */
  onError?: (error: unknown) => void;
}

/** A request handler for the built page, suitable as connectNodeAdapter's fallback. */
export function createStaticHandler(options: StaticHandlerOptions) {
  const root = path.resolve(options.root);
  return (req: Request, res: Response): void => {
    serve(root, req, res).catch((error: unknown) => {
      options.onError?.(error);
      if (!res.headersSent) send(res, 500, "text/plain; charset=utf-8", "internal error\n");
      else res.end();
    });
  };
}

async function serve(root: string, req: Request, res: Response): Promise<void> {
  if (req.method !== "GET" && req.method !== "HEAD") {
    res.setHeader("allow", "GET, HEAD");
    send(res, 405, "text/plain; charset=utf-8", "method not allowed\n");
    return;
  }
  const file = resolveFile(root, req.url ?? "/");
  if (file === undefined) {
    send(res, 404, "text/plain; charset=utf-8", "not found\n");
    return;
  }
  const info = await stat(file.path).catch(ignoreMissing);
  if (info === undefined || !info.isFile()) {
    const built = file.urlPath !== "/index.html" || (await isBuilt(root));
    send(res, 404, "text/plain; charset=utf-8", built ? "not found\n" : notBuilt);
    return;
  }
  const etag = `W/"${info.size.toString(16)}-${Math.floor(info.mtimeMs).toString(16)}"`;
  const headers: Record<string, string> = {
    "content-type": contentTypes[path.extname(file.path)] ?? "application/octet-stream",
    "cache-control": file.urlPath.startsWith(hashedPrefix) ? immutable : "no-cache",
    etag,
    "x-content-type-options": "nosniff",
    ...(file.urlPath.endsWith(".html") ? pageHeaders : {}),
  };
  if (req.headers["if-none-match"] === etag) {
    res.writeHead(304, headers);
    res.end();
    return;
  }
  const body = await readFile(file.path);
  res.writeHead(200, { ...headers, "content-length": String(body.length) });
  if (req.method === "HEAD") res.end();
  else res.end(body);
}

/**
 * Maps a request path to a file inside root, or undefined when the path is
 * malformed or would leave root: `..` and dot segments, encoded slashes and
 * backslashes, NUL bytes. The final check on the resolved path holds even if
 * a case slipped past the segment rules.
 */
export function resolveFile(
  root: string,
  rawUrl: string,
): { urlPath: string; path: string } | undefined {
  const rawPath = rawUrl.split("?", 1)[0] ?? "";
  if (!rawPath.startsWith("/")) return undefined;
  const segments: string[] = [];
  for (const raw of rawPath.split("/").slice(1)) {
    let segment: string;
    try {
      segment = decodeURIComponent(raw);
    } catch {
      return undefined;
    }
    if (segment.startsWith(".") || /[/\\\0]/.test(segment)) return undefined;
    segments.push(segment);
  }
  let urlPath = `/${segments.join("/")}`;
  if (urlPath.endsWith("/")) urlPath += "index.html";
  const full = path.resolve(root, `.${urlPath}`);
  if (!full.startsWith(root + path.sep)) return undefined;
  return { urlPath, path: full };
}

async function isBuilt(root: string): Promise<boolean> {
  const info = await stat(path.join(root, "index.html")).catch(ignoreMissing);
  return info?.isFile() ?? false;
}

function ignoreMissing(error: unknown): undefined {
  const code = (error as { code?: string }).code;
  if (code === "ENOENT" || code === "ENOTDIR") return undefined;
  throw error;
}

function send(res: Response, status: number, type: string, body: string): void {
  res.writeHead(status, {
    "content-type": type,
    "content-length": String(Buffer.byteLength(body)),
    "cache-control": "no-cache",
    "x-content-type-options": "nosniff",
  });
  res.end(body);
}
