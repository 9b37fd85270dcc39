/**
 * HTTP over TCP or a Unix socket, with node:http.
 *
 * The daemon listens on a Unix socket by default, which `fetch` cannot reach,
 * so every request goes through node:http (its `socketPath` option) instead.
 * URLs have the Python SDK's form (src/vmfork/client/transport.py):
 * `unix:///absolute/path/api.sock` or `http(s)://host:port[/prefix]`.
 *
 * One connection per request (no keep-alive agent), as in the Python SDK:
 * concurrent requests never share a socket, and a daemon restart never leaves
 * a stale pooled connection behind. A connect costs microseconds on a Unix
 * socket or loopback.
 */

import * as http from "node:http";
import * as https from "node:https";
import type { Readable } from "node:stream";

export interface Endpoint {
  readonly url: string;
  /** Set for `unix://` URLs. */
  readonly socketPath?: string;
  readonly protocol: "http:" | "https:";
  readonly hostname: string;
  readonly port?: number;
  /** Path prefix prepended to every request path (`http://h/prefix`); "" if none. */
  readonly prefix: string;
  /** PEM roots an `https:` daemon is verified against; the system's when unset. */
  readonly ca?: string | Buffer;
}

export function parseEndpoint(url: string): Endpoint {
  let parsed: URL;
  try {
    parsed = new URL(url);
  } catch {
    throw new TypeError(
      `${JSON.stringify(url)} is not a daemon URL: use http://HOST:PORT or unix:///path/to/api.sock`,
    );
  }
  if (parsed.protocol === "unix:") {
    const socketPath = decodeURIComponent(parsed.pathname);
    if (parsed.host !== "" || !socketPath.startsWith("/")) {
      throw new TypeError(
        `${JSON.stringify(url)}: a Unix socket URL is unix:///absolute/path.sock`,
      );
    }
    return { url, socketPath, protocol: "http:", hostname: "localhost", prefix: "" };
  }
  if ((parsed.protocol === "http:" || parsed.protocol === "https:") && parsed.hostname) {
    return {
      url,
      protocol: parsed.protocol,
      // URL keeps IPv6 literals bracketed; node:http wants them bare.
      hostname: parsed.hostname.replace(/^\[(.*)\]$/, "$1"),
      port: parsed.port ? Number(parsed.port) : undefined,
      prefix: parsed.pathname.replace(/\/+$/, ""),
    };
  }
  throw new TypeError(
    `${JSON.stringify(url)} is not a daemon URL: use http://HOST:PORT or unix:///path/to/api.sock`,
  );
}

export interface RawRequest {
  method: string;
  /** Path and query, already encoded, without the endpoint's prefix. */
  path: string;
  headers: Record<string, string>;
  body?: Buffer | Readable;
  /** Aborts the request, also while its response body is being read. */
  signal?: AbortSignal;
}

/**
 * Send one request and resolve with the response once its headers arrive; the
 * body is left to the caller to consume (or to `destroy()`). Aborting `signal`
 * at any time, also while the body is being read, destroys the connection.
 */
export function send(endpoint: Endpoint, req: RawRequest): Promise<http.IncomingMessage> {
  return new Promise((resolve, reject) => {
    if (req.signal?.aborted) {
      reject(abortReason(req.signal));
      return;
    }
    const options: http.RequestOptions = {
      method: req.method,
      path: endpoint.prefix + req.path,
      headers: req.headers,
      agent: false,
      signal: req.signal,
    };
    if (endpoint.socketPath !== undefined) {
      options.socketPath = endpoint.socketPath;
    } else {
      options.hostname = endpoint.hostname;
      if (endpoint.port !== undefined) options.port = endpoint.port;
    }
    let request: http.ClientRequest;
    if (endpoint.protocol === "https:") {
      // Verified (node's default), TLS 1.2 at least, as the daemon requires.
      const tls: https.RequestOptions = { ...options, minVersion: "TLSv1.2" };
      if (endpoint.ca !== undefined) tls.ca = endpoint.ca;
      request = https.request(tls, resolve);
    } else {
      request = http.request(options, resolve);
    }
    request.on("error", (err) => {
      reject(req.signal?.aborted ? abortReason(req.signal) : err);
    });
    if (req.body === undefined) {
      request.end();
    } else if (Buffer.isBuffer(req.body)) {
      request.end(req.body);
    } else {
      req.body.on("error", (err) => request.destroy(err));
      req.body.pipe(request);
    }
  });
}

export async function readAll(stream: AsyncIterable<unknown>): Promise<Buffer> {
  const chunks: Buffer[] = [];
  for await (const chunk of stream) chunks.push(Buffer.isBuffer(chunk) ? chunk : Buffer.from(String(chunk)));
  return Buffer.concat(chunks);
}

function abortReason(signal: AbortSignal): unknown {
  return signal.reason ?? new DOMException("This operation was aborted", "AbortError");
}
