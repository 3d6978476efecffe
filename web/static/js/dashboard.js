// A run's dashboard, kept live: headline numbers, alerts, charts, the volunteers' table.
import { Chart } from "./charts.js";
import { live } from "./live.js";
import { clock, element, eta, fixed, integer, minutes } from "./format.js";

const config = document.getElementById("dashboard-config").dataset;
const runId = config.runId;
const organizer = config.organizer === "yes";

const charts = {
  loss: new Chart(document.getElementById("chart-loss"), {
    xTime: false,
    xLabel: "samples",
    yLabels: ["loss", "eval metric"],
    series: [{ label: "loss" }, { label: "eval metric", scale: "y2" }],
  }),
  throughput: new Chart(document.getElementById("chart-throughput"), { series: [{ label: "samples/s" }] }),
  peers: new Chart(document.getElementById("chart-peers"), { series: [{ label: "peers online" }] }),
  groups: new Chart(document.getElementById("chart-groups"), { series: [{ label: "mean group size" }] }),
  groupDist: new Chart(document.getElementById("chart-group-dist"), {
    xTime: false,
    bars: true,
    xLabel: "group size",
    yLabels: ["reports"],
    series: [{ label: "reports" }],
  }),
  rounds: new Chart(document.getElementById("chart-rounds"), {
    series: [{ label: "rounds done" }, { label: "rounds failed" }],
  }),
};

let sortKey = "samples";
let sortDescending = true;
let latest = null;

function setMetric(name, text) {
  const node = document.querySelector(`[data-metric="${name}"]`);
  if (node && node.textContent !== String(text)) node.textContent = text;
}

function renderHeadline(document_) {
  const h = document_.headline;
  setMetric("epoch", h.epoch);
  setMetric("samples", integer(h.samples));
  setMetric("samples_per_second", fixed(h.samples_per_second, 1));
  setMetric("peers_online", h.peers_online);
  setMetric("loss", fixed(h.loss, 4));
  setMetric("eval_metric", fixed(h.eval_metric, 4));
  setMetric("rounds", `${h.rounds_done} / ${h.rounds_failed}`);
  setMetric("eta", eta(h.eta_s));
  setMetric(
    "checkpoint",
    h.checkpoint ? `epoch ${h.checkpoint.epoch}, ${Math.round(h.checkpoint.age_s / 60)} min ago` : "none yet",
  );
  const status = document.getElementById("run-status");
  status.textContent = document_.run.status;
  status.className = `badge badge-${document_.run.status}`;
}

function renderAlerts(alerts) {
  const box = document.getElementById("alerts");
  box.replaceChildren(
    ...alerts.map((alert) => {
      const node = element("p", alert.message, `alert alert-${alert.severity}`);
      node.dataset.alert = alert.kind;
      return node;
    }),
  );
}

function renderCharts(document_) {
  const s = document_.series;
  const bySamples = s.samples.map((x, i) => [x, s.loss[i], s.eval_metric[i]]).sort((a, b) => a[0] - b[0]);
  charts.loss.set([bySamples.map((r) => r[0]), bySamples.map((r) => r[1]), bySamples.map((r) => r[2])]);
  charts.throughput.set([s.t, s.samples_per_second]);
  charts.peers.set([s.t, s.peers_online]);
  charts.groups.set([s.t, s.mean_group_size]);
  const histogram = document_.group_sizes.histogram;
  charts.groupDist.set([histogram.map((b) => b.size), histogram.map((b) => b.count)]);
  charts.rounds.set([s.t, s.rounds_done, s.rounds_failed]);
}

function compare(a, b) {
  const x = a[sortKey];
  const y = b[sortKey];
  if (typeof x === "string" && typeof y === "string") return x.localeCompare(y);
  return (x ?? -Infinity) > (y ?? -Infinity) ? 1 : (x ?? -Infinity) < (y ?? -Infinity) ? -1 : 0;
}

function renderVolunteers(volunteers) {
  const rows = [...volunteers].sort((a, b) => (sortDescending ? -compare(a, b) : compare(a, b)));
  const body = document.querySelector("#volunteers tbody");
  if (rows.length === 0) {
    const row = element("tr");
    const cell = element("td", "Nobody has joined yet.");
    cell.colSpan = 6;
    row.append(cell);
    body.replaceChildren(row);
    return;
  }
  body.replaceChildren(
    ...rows.map((v) => {
      const row = element("tr");
      row.dataset.volunteerId = v.id;
      const name = element("th");
      name.scope = "row";
      const link = element("a", v.display_name);
      link.href = `/runs/${encodeURIComponent(runId)}/volunteers/${v.id}`;
      name.append(link);
      if (v.banned) name.append(" ", element("span", "banned", "badge badge-banned"));
      const seen = element("td", clock(v.last_seen));
      if (v.online) seen.append(" ", element("span", "online", "badge badge-running"));
      row.append(
        name,
        element("td", integer(v.samples), "num"),
        element("td", `${(v.share * 100).toFixed(1)} %`, "num"),
        element("td", minutes(v.online_s), "num"),
        seen,
        element("td", !v.peers ? "–" : v.reachable ? "reachable" : "client mode"),
      );
      if (organizer) {
        const cell = element("td");
        if (!v.banned) {
          const form = document.getElementById("ban-form-template").content.firstElementChild.cloneNode(true);
          form.action = `/runs/${encodeURIComponent(runId)}/volunteers/${v.id}/ban`;
          form.querySelector("button").setAttribute("aria-label", `Ban ${v.display_name}`);
          cell.append(form);
        }
        row.append(cell);
      }
      return row;
    }),
  );
}

function apply(document_) {
  latest = document_;
  renderHeadline(document_);
  renderAlerts(document_.alerts);
  renderCharts(document_);
  renderVolunteers(document_.volunteers);
}

for (const button of document.querySelectorAll("#volunteers button.sort")) {
  button.addEventListener("click", () => {
    const key = button.dataset.key;
    sortDescending = key === sortKey ? !sortDescending : key !== "display_name";
    sortKey = key;
    for (const header of document.querySelectorAll("#volunteers th[aria-sort]")) {
      header.setAttribute("aria-sort", "none");
    }
    button.parentElement.setAttribute("aria-sort", sortDescending ? "descending" : "ascending");
    if (latest) renderVolunteers(latest.volunteers);
  });
}

live({
  socketPath: `/api/v1/runs/${encodeURIComponent(runId)}/live`,
  pollPath: `/api/v1/runs/${encodeURIComponent(runId)}/dashboard`,
  status: document.getElementById("live-status"),
  onDocument: apply,
});
