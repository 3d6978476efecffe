// uPlot charts that follow their container's width (uPlot is loaded as a global script).
// Every number on them goes through format.js; times are UTC, as everywhere on the pages.
import { axisNumbers, axisTime, datetime, integer, element } from "./format.js";

const HEIGHT = 200;
const COLORS = ["#1f5fbf", "#b3361d", "#2e7d32", "#7b3fa0"];
// Time splits: whole seconds at least, on round minutes and hours.
const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800];
const INTEGER_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6, 1e7, 1e8, 1e9];

function integerAxis(axis) {
  return {
    ...axis,
    incrs: INTEGER_STEPS,
    values: (u, splits) => splits.map((v) => (Number.isInteger(v) ? integer(v) : "")),
  };
}

function countRange(u, min, max) {
  return [0, Math.max(1, Math.ceil(max ?? 1))];
}

// kind: "time" (x is Unix seconds), "number" (x is a quantity, e.g. samples) or
// "histogram" (x is a whole number from 0, drawn as bars).
// series: [{label, scale?: "y"|"y2", format(value) -> text, integer?: bool}]
export class Chart {
  constructor(container, { kind = "time", series, xLabel = "", xFormat = integer, yLabels = [] }) {
    this.container = container;
    container.swarmgradChart = this; // for the browser tests
    this.kind = kind;
    const time = kind === "time";
    const counts = series.filter((s) => (s.scale || "y") === "y").every((s) => s.integer);
    const y2 = series.some((s) => s.scale === "y2");
    const xAxis = time
      ? {
          label: "time (UTC)",
          space: 80,
          incrs: TIME_STEPS,
          values: (u, splits) => {
            const span = (u.scales.x.max ?? 0) - (u.scales.x.min ?? 0);
            return splits.map((t) => axisTime(t, span < 600));
          },
        }
      : kind === "histogram"
        ? integerAxis({ label: xLabel, space: 40 })
        : { label: xLabel, space: 70, values: (u, splits) => axisNumbers(splits) };
    const yAxis = { label: yLabels[0] || "", size: 60, values: (u, splits) => axisNumbers(splits) };
    this.options = {
      width: this.width(),
      height: HEIGHT,
      legend: { show: true, live: true },
      // Time splits fall on whole UTC minutes and hours, as the labels say.
      tzDate: (ts) => uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"),
      cursor: { points: { size: 7 } },
      scales: {
        x: time ? { time: true } : kind === "histogram" ? { time: false, range: (u, min, max) => [-0.5, Math.max(1, max ?? 1) + 0.5] } : { time: false },
        y: counts ? { range: countRange } : { auto: true },
        ...(y2 ? { y2: { auto: true } } : {}),
      },
      axes: [
        { ...xAxis, stroke: "#333" },
        { ...(counts ? integerAxis(yAxis) : yAxis), stroke: "#333" },
        ...(y2
          ? [{ scale: "y2", side: 1, size: 60, label: yLabels[1] || "", stroke: "#333", grid: { show: false }, values: (u, splits) => axisNumbers(splits) }]
          : []),
      ],
      series: [
        { label: time ? "time (UTC)" : xLabel, value: (u, v) => (v == null ? "–" : time ? datetime(v) : xFormat(v)) },
        ...series.map((s, i) => ({
          label: s.label,
          scale: s.scale || "y",
          stroke: COLORS[i % COLORS.length],
          width: 2,
          value: (u, v) => (v == null ? "–" : s.format(v)),
          fill: kind === "histogram" ? `${COLORS[i % COLORS.length]}55` : undefined,
          // A count over time holds until it changes: steps, not a slope between two reports.
          paths:
            kind === "histogram"
              ? uPlot.paths.bars({ size: [0.7, Infinity], align: 0 })
              : time && s.integer
                ? uPlot.paths.stepped({ align: 1 })
                : undefined,
          points: { show: kind === "histogram" ? false : undefined },
          spanGaps: true,
        })),
      ],
    };
    this.plot = null;
    this.empty = null;
    new ResizeObserver(() => this.resize()).observe(container);
  }

  width() {
    return Math.max(200, Math.floor(this.container.clientWidth));
  }

  set(data) {
    const points = data[0].length;
    if (points === 0) {
      if (this.empty === null) {
        this.empty = element("p", "No data yet.", "empty");
        this.container.append(this.empty);
      }
      return;
    }
    if (this.empty !== null) {
      this.empty.remove();
      this.empty = null;
    }
    if (this.plot === null) {
      this.plot = new uPlot(this.options, data, this.container);
    } else {
      this.plot.setData(data);
    }
  }

  resize() {
    if (this.plot !== null && Math.abs(this.plot.width - this.width()) > 1) {
      this.plot.setSize({ width: this.width(), height: HEIGHT });
    }
  }
}

// A histogram's bins: every whole number from 0 to the largest, those with no count at 0.
export function integerBins(histogram) {
  const largest = histogram.reduce((m, b) => Math.max(m, b.size), 0);
  const counts = new Array(largest + 1).fill(0);
  for (const b of histogram) if (b.size >= 0) counts[b.size] = b.count;
  return [counts.map((_, i) => i), counts];
}
