// uPlot charts that follow their container's width (uPlot is loaded as a global script).

const HEIGHT = 190;
const COLORS = ["#1f5fbf", "#b3361d", "#2e7d32", "#7b3fa0"];

export class Chart {
  constructor(container, { series, xTime = true, bars = false, xLabel = "", yLabels = [] }) {
    this.container = container;
    this.options = {
      width: this.width(),
      height: HEIGHT,
      legend: { show: series.length > 1 },
      scales: { x: { time: xTime }, y2: { auto: true } },
      axes: [
        { label: xLabel, stroke: "#333" },
        { label: yLabels[0] || "", stroke: "#333" },
        ...(series.some((s) => s.scale === "y2") ? [{ scale: "y2", side: 1, label: yLabels[1] || "", stroke: "#333", grid: { show: false } }] : []),
      ],
      series: [
        {},
        ...series.map((s, i) => ({
          label: s.label,
          scale: s.scale || "y",
          stroke: COLORS[i % COLORS.length],
          width: 2,
          fill: bars ? `${COLORS[i % COLORS.length]}55` : undefined,
          paths: bars ? uPlot.paths.bars({ size: [0.6, 60] }) : undefined,
          points: { show: bars ? false : undefined },
          spanGaps: true,
        })),
      ],
    };
    this.plot = null;
    this.pending = null;
    new ResizeObserver(() => this.resize()).observe(container);
  }

  width() {
    return Math.max(200, Math.floor(this.container.clientWidth));
  }

  set(data) {
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
