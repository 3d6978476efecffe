// A live view: the coordinator's WebSocket pushes the view's document whenever it changes.
// While the socket is down, the page polls the JSON endpoint instead and shows
// "Reconnecting…"; it reconnects with backoff and takes the fresh document it is sent first.

const POLL_MS = 3000;
const MAX_BACKOFF_MS = 15000;

export function live({ socketPath, pollPath, status, onDocument }) {
  let backoff = 500;
  let pollTimer = null;
  let socket = null;

  function show(state, text) {
    if (!status) return;
    status.dataset.state = state;
    status.textContent = text;
  }

  async function pollOnce() {
    try {
      const answer = await fetch(pollPath, { headers: { Accept: "application/json" }, cache: "no-store" });
      if (answer.ok) onDocument(await answer.json());
    } catch (error) {
      // the coordinator is unreachable: keep the last numbers, try again later
    }
  }

  function startPolling() {
    if (pollTimer === null) pollTimer = setInterval(pollOnce, POLL_MS);
  }

  function stopPolling() {
    if (pollTimer !== null) clearInterval(pollTimer);
    pollTimer = null;
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    try {
      socket = new WebSocket(`${scheme}//${location.host}${socketPath}`);
    } catch (error) {
      scheduleReconnect();
      return;
    }
    socket.addEventListener("open", () => {
      backoff = 500;
      stopPolling();
      show("live", "Live");
    });
    socket.addEventListener("message", (event) => {
      let frame;
      try {
        frame = JSON.parse(event.data);
      } catch (error) {
        return;
      }
      if (frame && frame.data) onDocument(frame.data);
    });
    socket.addEventListener("close", (event) => {
      if (event.code === 4404) {
        show("gone", "This run no longer exists");
        return;
      }
      scheduleReconnect();
    });
  }

  function scheduleReconnect() {
    show("reconnecting", "Reconnecting…");
    startPolling();
    setTimeout(connect, backoff);
    backoff = Math.min(backoff * 2, MAX_BACKOFF_MS);
  }

  if (!("WebSocket" in window)) {
    show("polling", "Polling");
    startPolling();
    return;
  }
  connect();
}
