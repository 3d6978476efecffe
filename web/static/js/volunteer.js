// A volunteer's page: their cumulative samples over time. While the page is visible it reads
// itself again every REFRESH_MS and swaps in the new numbers, machines and sessions (so a
// machine that stopped shows offline, as on the run's dashboard); "last seen" times grow in
// between.
import { Chart } from "./charts.js";
import { integer, keepRelativeTimesGrowing, refreshRelative, setServerNow } from "./format.js";

const REFRESH_MS = 10000;
const LIVE_PARTS = ["volunteer-metrics", "machines", "sessions"];

const chart = new Chart(document.getElementById("chart-volunteer-samples"), {
  yLabels: ["samples"],
  series: [{ label: "samples", format: integer, integer: true }],
});

function show(config) {
  const series = JSON.parse(config.dataset.series);
  chart.set([series.t, series.samples]);
}

async function refresh() {
  if (document.visibilityState !== "visible") return;
  let answer;
  try {
    answer = await fetch(window.location.href, { headers: { Accept: "text/html" } });
  } catch {
    return; // the coordinator is away: try again at the next tick
  }
  if (!answer.ok) return;
  const fresh = new DOMParser().parseFromString(await answer.text(), "text/html");
  for (const id of LIVE_PARTS) {
    const now = fresh.getElementById(id);
    const here = document.getElementById(id);
    if (now && here) here.replaceWith(document.adoptNode(now));
  }
  const main = fresh.querySelector("main[data-server-now]");
  if (main) setServerNow(main.dataset.serverNow);
  const config = fresh.getElementById("volunteer-config");
  if (config) show(config);
  refreshRelative();
}

show(document.getElementById("volunteer-config"));
keepRelativeTimesGrowing();
setInterval(refresh, REFRESH_MS);
document.addEventListener("visibilitychange", refresh);
