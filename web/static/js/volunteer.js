// A volunteer's page: their cumulative samples over time.
import { Chart } from "./charts.js";

const series = JSON.parse(document.getElementById("volunteer-config").dataset.series);
new Chart(document.getElementById("chart-volunteer-samples"), { series: [{ label: "samples" }] }).set([
  series.t,
  series.samples,
]);
