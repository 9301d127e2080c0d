// Talking to this server: the API key, fetch with `Authorization: Bearer`, OpenAI-style errors,
// and Server-Sent Events read from a fetch body (EventSource cannot POST or send headers).

const KEY_ITEM = "omnistage-api-key";

export class AuthError extends Error {}

export class ApiError extends Error {
  constructor(status, message, param) {
    super(message);
    this.status = status;
    this.param = param;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY_ITEM) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_ITEM, key);
  else sessionStorage.removeItem(KEY_ITEM);
}

function withAuth(headers = {}) {
  const key = apiKey();
  return key ? { ...headers, Authorization: `Bearer ${key}` } : headers;
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let param = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      param = body.error.param || null;
    }
  } catch (_) {
    // not JSON: keep the status line
  }
  if (response.status === 401) return new AuthError(message);
  return new ApiError(response.status, param ? `${message} (field: ${param})` : message, param);
}

// fetch(path) with the key; a non-2xx answer throws AuthError (401) or ApiError.
export async function request(path, { method = "GET", json, form, signal, headers } = {}) {
  const init = { method, signal, headers: withAuth(headers) };
  if (json !== undefined) {
    init.body = JSON.stringify(json);
    init.headers["Content-Type"] = "application/json";
  } else if (form !== undefined) {
    init.body = form;
  }
  const response = await fetch(path, init);
  if (!response.ok) throw await errorOf(response);
  return response;
}

export async function getJSON(path, options) {
  return (await request(path, options)).json();
}

// Calls onEvent({event, data}) for each SSE event of a streamed response body, as it arrives.
export async function readSSE(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        else if (line.startsWith("event:")) event = line.slice(6).trim();
      }
      if (data.length) onEvent({ event, data: data.join("\n") });
    }
  }
}

// An error event of a stream ({"error": {...}} or {"type": "error", "error": {...}}) -> ApiError.
export function streamError(payload) {
  if (payload && payload.error) {
    const e = payload.error;
    return new ApiError(500, e.message || "the stream failed", e.param || null);
  }
  return null;
}

export function base64ToBytes(b64) {
  const text = atob(b64);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  return bytes;
}

export function fileToDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}
