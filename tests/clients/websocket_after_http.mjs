// A WebSocket opened after HTTP calls, as Node 22 opens one: its built-in WebSocket is undici's,
// which sends the upgrade on a kept-alive connection of its pool that has already served the
// calls (a pool of one connection here, so it must). `ws` opens a connection of its own.
// Usage: node websocket_after_http.mjs HOST:PORT undici|ws; prints one JSON line.
import { fetch, Agent, WebSocket as UndiciWebSocket } from "undici";
import WsWebSocket from "ws";

const [base, kind] = process.argv.slice(2);
const agent = new Agent({ connections: 1 });
const statuses = [];
for (const path of ["/healthz", "/v1/models"]) {
  const answer = await fetch(`http://${base}${path}`, { dispatcher: agent });
  statuses.push(answer.status);
  await answer.text();
}
const url = `ws://${base}/v1/responses`;
const ws = kind === "undici" ? new UndiciWebSocket(url, { dispatcher: agent }) : new WsWebSocket(url);
const timer = setTimeout(() => finish({ error: "no response.completed within 20 s" }), 20000);
const types = [];
function finish(result) {
  clearTimeout(timer);
  console.log(JSON.stringify({ statuses, types, ...result }));
  process.exit(result.error ? 1 : 0);
}
ws.onopen = () => ws.send(JSON.stringify({ type: "response.create", model: "m", input: "hi" }));
ws.onerror = (event) => finish({ error: String(event.message ?? event.type) });
ws.onmessage = (message) => {
  const event = JSON.parse(String(message.data));
  types.push(event.type);
  if (event.type === "response.completed") {
    ws.close();
    finish({ status: event.response.status });
  }
};
