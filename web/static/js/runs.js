// The runs list, kept live: numbers per row and a throughput sparkline.
import { live } from "./live.js";
import { integer, rate } from "./format.js";

const SVG = "http://www.w3.org/2000/svg";

function sparkline(cell, values) {
  cell.replaceChildren();
  if (!values || values.length < 2) return;
  const width = 100;
  const height = 24;
  const max = Math.max(...values, 1e-9);
  const points = values
    .map((v, i) => `${((i / (values.length - 1)) * width).toFixed(1)},${(height - (v / max) * (height - 2) - 1).toFixed(1)}`)
    .join(" ");
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("class", "sparkline");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", `samples per second, last ${values.length} points`);
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", points);
  svg.append(line);
  cell.append(svg);
}

function apply(overview) {
  for (const run of overview.runs) {
    const row = document.querySelector(`tr[data-run-id="${CSS.escape(run.id)}"]`);
    if (!row) continue; // a new run: shown on the next load
    const set = (field, text) => {
      const cell = row.querySelector(`[data-field="${field}"]`);
      if (cell) cell.textContent = text;
    };
    set("epoch", integer(run.epoch));
    set("samples", integer(run.samples));
    set("peers_online", integer(run.peers_online));
    set("samples_per_second", rate(run.samples_per_second));
    const badge = row.querySelector('[data-field="status"] .badge');
    if (badge) {
      badge.textContent = run.status;
      badge.className = `badge badge-${run.status}`;
    }
    const detail = row.querySelector('[data-field="status"] .status-detail');
    if (detail) detail.textContent = run.status_detail || "";
    sparkline(row.querySelector('[data-field="trend"]'), run.trend);
  }
}

for (const cell of document.querySelectorAll("td[data-trend]")) {
  try {
    sparkline(cell, JSON.parse(cell.dataset.trend));
  } catch (error) {
    // leave the cell empty
  }
}

live({
  socketPath: "/api/v1/live",
  pollPath: "/api/v1/dashboard",
  status: document.getElementById("live-status"),
  onDocument: apply,
});
