// A volunteer's page: their cumulative samples over time; "last seen" times keep growing.
import { Chart } from "./charts.js";
import { integer, keepRelativeTimesGrowing } from "./format.js";

const series = JSON.parse(document.getElementById("volunteer-config").dataset.series);
new Chart(document.getElementById("chart-volunteer-samples"), {
  yLabels: ["samples"],
  series: [{ label: "samples", format: integer, integer: true }],
}).set([series.t, series.samples]);
keepRelativeTimesGrowing();
