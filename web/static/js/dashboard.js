// A run's dashboard, kept live: headline numbers, alerts, charts, the volunteers' table.
import { Chart, integerBins } from "./charts.js";
import { live } from "./live.js";
import {
  duration,
  element,
  eta,
  integer,
  keepRelativeTimesGrowing,
  measure,
  percent,
  rate,
  setServerNow,
  timeAgo,
} from "./format.js";

const config = document.getElementById("dashboard-config").dataset;
const runId = config.runId;
const organizer = config.organizer === "yes";

const charts = {
  loss: new Chart(document.getElementById("chart-loss"), {
    kind: "number",
    xLabel: "samples",
    yLabels: ["loss", "eval metric"],
    series: [
      { label: "loss", format: measure },
      { label: "eval metric", scale: "y2", format: measure },
    ],
  }),
  throughput: new Chart(document.getElementById("chart-throughput"), {
    yLabels: ["samples/s"],
    series: [{ label: "samples/s", format: rate }],
  }),
  peers: new Chart(document.getElementById("chart-peers"), {
    yLabels: ["peers"],
    series: [{ label: "peers online", format: integer, integer: true }],
  }),
  groups: new Chart(document.getElementById("chart-groups"), {
    yLabels: ["peers per group"],
    series: [{ label: "mean group size", format: measure }],
  }),
  groupDist: new Chart(document.getElementById("chart-group-dist"), {
    kind: "histogram",
    xLabel: "group size",
    yLabels: ["reports"],
    series: [{ label: "reports", format: integer, integer: true }],
  }),
  rounds: new Chart(document.getElementById("chart-rounds"), {
    yLabels: ["rounds"],
    series: [
      { label: "rounds done", format: integer, integer: true },
      { label: "rounds failed", format: integer, integer: true },
    ],
  }),
};

// The volunteers' table shows one page, sorted and filtered by the coordinator. The live
// feed carries the first page by samples; any other view is asked for again on each update.
const pager = document.getElementById("volunteers-pager");
const view = {
  page: Number(pager.dataset.page) || 1,
  per_page: Number(pager.dataset.perPage) || 50,
  sort: pager.dataset.sort || "samples",
  order: pager.dataset.order || "desc",
  q: pager.dataset.q || "",
};
const volunteersPath = `/api/v1/runs/${encodeURIComponent(runId)}/volunteers`;
let asked = 0; // the latest page request's number: older answers are dropped
let pageInFlight = false;
let pageWanted = false;

function setMetric(name, text, note) {
  const node = document.querySelector(`[data-metric="${name}"]`);
  if (!node) return;
  const wanted = note ? `${text} (${note})` : String(text);
  if (node.textContent === wanted) return;
  node.replaceChildren(String(text));
  if (note) node.append(" ", element("small", `(${note})`));
}

function renderHeadline(document_) {
  const h = document_.headline;
  const status = document_.run.status;
  setMetric("epoch", integer(h.epoch));
  setMetric("samples", integer(h.samples));
  if (status === "running") setMetric("samples_per_second", rate(h.samples_per_second));
  else setMetric("samples_per_second", "0", status);
  setMetric("peers_online", integer(h.peers_online));
  setMetric("loss", measure(h.loss));
  setMetric("eval_metric", measure(h.eval_metric));
  setMetric("rounds", `${integer(h.rounds_done)} / ${integer(h.rounds_failed)}`);
  setMetric("bytes_per_sample", integer(h.bytes_per_sample));
  setMetric("eta", eta(h.eta_s), status === "paused" && h.eta_s ? "paused" : null);
  const checkpoint = document.querySelector('[data-metric="checkpoint"]');
  if (h.checkpoint) {
    const when = timeAgo(h.checkpoint.created_at);
    const text = `epoch ${integer(h.checkpoint.epoch)}, ${when.textContent}`;
    if (checkpoint.textContent !== text) checkpoint.replaceChildren(`epoch ${integer(h.checkpoint.epoch)}, `, when);
  } else if (checkpoint.textContent !== "none yet") {
    checkpoint.textContent = "none yet";
  }
  const badge = document.getElementById("run-status");
  badge.textContent = status;
  badge.className = `badge badge-${status}`;
  const detail = document_.run.status_detail;
  const why = document.getElementById("run-status-detail");
  if (why) {
    const text = detail ? `${status}: ${detail}` : "";
    if (why.textContent !== text) why.textContent = text;
    why.hidden = !detail;
  }
  renderActions(status, Boolean(detail));
}

// The organizer's buttons follow the run's state: Pause while running, Resume while paused,
// Finish until finished.
const HINTS = {
  running: "Pausing lets volunteers wait; finishing stops the run for good (you will be asked to confirm).",
  paused: "The run is paused: volunteers wait until you resume it.",
  waiting: "The run waits for its volunteers and starts by itself once they are online; Resume starts it now.",
  finished: "The run is finished: nothing more can be done to it.",
};

function renderActions(status, explained) {
  for (const button of document.querySelectorAll("#run-actions [data-enabled-when]")) {
    button.disabled = !button.dataset.enabledWhen.split(" ").includes(status);
  }
  const hint = document.getElementById("actions-hint");
  const wanted = HINTS[status === "paused" && explained ? "waiting" : status];
  if (hint && wanted && hint.textContent !== wanted) hint.textContent = wanted;
}

function renderAlerts(alerts) {
  const box = document.getElementById("alerts");
  box.replaceChildren(
    ...alerts.map((alert) => {
      const node = element("p", alert.message, `alert alert-${alert.severity}`);
      node.dataset.alert = alert.kind;
      // what would help (an averaging alert's fix), after the reason
      if (alert.help) node.append(" ", element("span", alert.help, "alert-help"));
      return node;
    }),
  );
}

function renderCharts(document_) {
  const s = document_.series;
  const bySamples = s.samples.map((x, i) => [x, s.loss[i], s.eval_metric[i]]).sort((a, b) => a[0] - b[0]);
  charts.loss.set([bySamples.map((r) => r[0]), bySamples.map((r) => r[1]), bySamples.map((r) => r[2])]);
  // The history is the coordinator's snapshots, taken as reports arrive; the charts end with
  // the numbers of now (peers that left, a pause), as the headline shows them.
  const h = document_.headline;
  const now = Date.parse(document_.now) / 1000;
  const last = s.t.length ? s.t[s.t.length - 1] : -Infinity;
  const upToNow = (values, current) => (now > last + 1 ? [...values, current] : values);
  const t = upToNow(s.t, now);
  const rate = document_.run.status === "running" ? h.samples_per_second : 0;
  charts.throughput.set([t, upToNow(s.samples_per_second, rate)]);
  charts.peers.set([t, upToNow(s.peers_online, h.peers_online)]);
  charts.groups.set([s.t, s.mean_group_size]);
  charts.groupDist.set(integerBins(document_.group_sizes.histogram));
  charts.rounds.set([t, upToNow(s.rounds_done, h.rounds_done), upToNow(s.rounds_failed, h.rounds_failed)]);
}

function cell(label, text, className) {
  const node = element("td", text, className);
  node.dataset.label = label;
  return node;
}

function isDefaultView() {
  return view.page === 1 && view.per_page === 50 && view.sort === "samples" && view.order === "desc" && !view.q.trim();
}

function pageQuery(page) {
  const query = new URLSearchParams({ page: String(page), sort: view.sort, order: view.order });
  if (view.per_page !== 50) query.set("per_page", String(view.per_page));
  if (view.q) query.set("q", view.q);
  return query.toString();
}

function renderPager(info) {
  view.page = info.page; // the coordinator clamps a page past the last one
  const previous = document.getElementById("volunteers-previous");
  const next = document.getElementById("volunteers-next");
  previous.hidden = info.page <= 1;
  next.hidden = info.page >= info.pages;
  previous.href = `/runs/${encodeURIComponent(runId)}?${pageQuery(info.page - 1)}#volunteers-heading`;
  next.href = `/runs/${encodeURIComponent(runId)}?${pageQuery(info.page + 1)}#volunteers-heading`;
  const which = info.q ? `${integer(info.matching)} matching of ${integer(info.total)}` : `${integer(info.matching)} volunteers`;
  const text = `Page ${integer(info.page)} of ${integer(info.pages)}: ${which}, ${integer(info.online)} online`;
  const position = document.getElementById("volunteers-position");
  if (position.textContent !== text) position.textContent = text;
  for (const header of document.querySelectorAll("#volunteers th[aria-sort]")) {
    const key = header.querySelector("button.sort")?.dataset.key;
    const sorted = key === info.sort ? (info.order === "desc" ? "descending" : "ascending") : "none";
    if (header.getAttribute("aria-sort") !== sorted) header.setAttribute("aria-sort", sorted);
  }
}

// One request at a time; a change meanwhile asks again once it is answered.
async function requestPage() {
  if (pageInFlight) {
    pageWanted = true;
    return;
  }
  pageInFlight = true;
  pageWanted = false;
  const number = ++asked;
  try {
    const answer = await fetch(`${volunteersPath}?${pageQuery(view.page)}`, {
      headers: { Accept: "application/json" },
      cache: "no-store",
    });
    if (answer.ok) {
      const page = await answer.json();
      if (number === asked) {
        renderPager(page.volunteers_page);
        renderVolunteers(page.volunteers, page.volunteers_page);
      }
    }
  } catch (error) {
    // the coordinator is unreachable: keep the rows shown, the next update asks again
  } finally {
    pageInFlight = false;
    if (pageWanted) requestPage();
  }
}

function renderVolunteers(rows, info) {
  const body = document.querySelector("#volunteers tbody");
  if (rows.length === 0) {
    const row = element("tr");
    const empty = element("td", info.q && info.total ? "No volunteer's name matches." : "Nobody has joined yet.");
    empty.colSpan = organizer ? 7 : 6;
    row.append(empty);
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
      name.dataset.label = "Name";
      const seen = cell("Last seen");
      seen.append(timeAgo(v.last_seen));
      if (v.online) seen.append(" ", element("span", "online", "badge badge-running"));
      row.append(
        name,
        cell("Samples", integer(v.samples), "num"),
        cell("Share", percent(v.share), "num"),
        cell("Time online", duration(v.online_s), "num"),
        seen,
        cell(
          "Connectivity",
          !v.peers ? "–" : v.reachable ? "reachable" : v.behind_nat ? "behind NAT (punched)" : "client mode",
        ),
      );
      if (organizer) {
        const actionCell = element("td", null, "action");
        if (!v.banned) {
          const form = document.getElementById("ban-form-template").content.firstElementChild.cloneNode(true);
          form.action = `/runs/${encodeURIComponent(runId)}/volunteers/${v.id}/ban`;
          form.querySelector("button").setAttribute("aria-label", `Ban ${v.display_name}`);
          actionCell.append(form);
        }
        row.append(actionCell);
      }
      return row;
    }),
  );
}

function apply(document_) {
  setServerNow(document_.now);
  renderHeadline(document_);
  renderAlerts(document_.alerts);
  renderCharts(document_);
  if (isDefaultView()) {
    asked++; // an answer to an older request would be staler than this document
    renderPager(document_.volunteers_page);
    renderVolunteers(document_.volunteers, document_.volunteers_page);
  } else {
    requestPage();
  }
}

for (const button of document.querySelectorAll("#volunteers button.sort")) {
  button.addEventListener("click", () => {
    const key = button.dataset.key;
    view.order = key === view.sort ? (view.order === "desc" ? "asc" : "desc") : key === "display_name" ? "asc" : "desc";
    view.sort = key;
    view.page = 1;
    requestPage();
  });
}

for (const [id, step] of [
  ["volunteers-previous", -1],
  ["volunteers-next", 1],
]) {
  document.getElementById(id).addEventListener("click", (event) => {
    event.preventDefault();
    view.page = Math.max(1, view.page + step);
    requestPage();
  });
}

const filter = document.getElementById("volunteers-filter");
const filterInput = document.getElementById("volunteers-q");
let filterTimer = null;
function applyFilter() {
  if (filterInput.value === view.q) return;
  view.q = filterInput.value;
  view.page = 1;
  requestPage();
}
filter.addEventListener("submit", (event) => {
  event.preventDefault();
  clearTimeout(filterTimer);
  applyFilter();
});
filterInput.addEventListener("input", () => {
  clearTimeout(filterTimer);
  filterTimer = setTimeout(applyFilter, 300);
});

keepRelativeTimesGrowing();

live({
  socketPath: `/api/v1/runs/${encodeURIComponent(runId)}/live`,
  pollPath: `/api/v1/runs/${encodeURIComponent(runId)}/dashboard`,
  status: document.getElementById("live-status"),
  onDocument: apply,
});
