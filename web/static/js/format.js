// The one way the pages write numbers and times; server/web/formatting.py writes the same
// text for the first render (tests/web/test_formatting.py checks that the two agree).
//
// - counts: thousands separators ("12,544");
// - rates: whole numbers from 100 up ("47,108"), one decimal below, two below 1;
// - measured values (loss, metrics): four significant digits, never an exponent;
// - durations grow ("45 s", "12 min", "3 h 5 min", "2 d 4 h"), relative times too ("just
//   now", "40 s ago", "3 min ago");
// - wall-clock times in UTC, 24-hour, with the zone written ("2026-11-26 22:53:07 UTC").

const DASH = "–";

// Scripts run on this page: charts take their room (see app.css).
document.documentElement.classList.add("js");

export function integer(value) {
  if (value === null || value === undefined || !Number.isFinite(Number(value))) return DASH;
  return Math.round(Number(value)).toLocaleString("en-US");
}

export function rate(value) {
  if (value === null || value === undefined || !Number.isFinite(Number(value))) return DASH;
  const x = Number(value);
  const a = Math.abs(x);
  if (a >= 100) return integer(x);
  if (a >= 1) return x.toFixed(1);
  if (a === 0) return "0";
  return x.toFixed(2);
}

export function measure(value) {
  if (value === null || value === undefined || !Number.isFinite(Number(value))) return DASH;
  const x = Number(value);
  const a = Math.abs(x);
  if (a === 0) return "0";
  if (a >= 1000) return integer(x);
  const digits = Math.min(8, Math.max(0, 3 - Math.floor(Math.log10(a))));
  return x.toFixed(digits);
}

export function percent(fraction) {
  if (fraction === null || fraction === undefined) return DASH;
  const p = Number(fraction) * 100;
  if (p > 0 && p < 0.1) return "<0.1 %";
  return `${p.toFixed(1)} %`;
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(Number(seconds))) return DASH;
  const s = Math.max(0, Math.round(Number(seconds)));
  if (s < 60) return `${s} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m} min`;
  const h = Math.floor(m / 60);
  if (h < 24) return m % 60 ? `${h} h ${m % 60} min` : `${h} h`;
  const d = Math.floor(h / 24);
  return h % 24 ? `${d} d ${h % 24} h` : `${d} d`;
}

export function ago(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(Number(seconds))) return "never";
  const s = Math.max(0, Math.floor(Number(seconds)));
  if (s < 10) return "just now";
  if (s < 60) return `${s} s ago`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m} min ago`;
  const h = Math.floor(m / 60);
  if (h < 24) return `${h} h ago`;
  return `${Math.floor(h / 24)} d ago`;
}

export function eta(seconds) {
  if (seconds === null || seconds === undefined) return DASH;
  if (Number(seconds) === 0) return "reached";
  return duration(Math.ceil(Number(seconds)));
}

// An axis's labels: as many decimals as its step needs, the same for every label
// ("0", "0.5", "1.0"; "2,000", "4,000").
export function axisNumbers(splits) {
  const steps = splits.slice(1).map((v, i) => Math.abs(v - splits[i])).filter((d) => d > 0);
  const step = steps.length ? Math.min(...steps) : 1;
  const digits = Math.min(8, Math.max(0, -Math.floor(Math.log10(step) + 1e-9)));
  return splits.map((v) =>
    v === null || v === undefined
      ? ""
      : Number(v).toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits }),
  );
}

function pad(n) {
  return String(n).padStart(2, "0");
}

// "2026-11-26 22:53:07 UTC" (an ISO string, or Unix seconds).
export function datetime(value) {
  if (value === null || value === undefined || value === "") return "never";
  const d = typeof value === "number" ? new Date(value * 1000) : new Date(value);
  if (Number.isNaN(d.getTime())) return DASH;
  return `${d.getUTCFullYear()}-${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())} ${clockOf(d)} UTC`;
}

function clockOf(d) {
  return `${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}:${pad(d.getUTCSeconds())}`;
}

// A chart's time axis: "22:53" (UTC; the axis names the zone), with seconds when they matter.
export function axisTime(unixSeconds, withSeconds) {
  const d = new Date(unixSeconds * 1000);
  const hm = `${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}`;
  return withSeconds ? `${hm}:${pad(d.getUTCSeconds())}` : hm;
}

// The server's clock minus this browser's (ms): relative times count from the server's "now".
let skewMs = 0;
export function setServerNow(iso) {
  const t = new Date(iso).getTime();
  if (!Number.isNaN(t)) skewMs = t - Date.now();
}

export function secondsSince(iso) {
  if (!iso) return null;
  const t = new Date(iso).getTime();
  if (Number.isNaN(t)) return null;
  return (Date.now() + skewMs - t) / 1000;
}

// <time datetime="..." data-ago> elements: their text grows as time passes.
export function refreshRelative(root = document) {
  for (const node of root.querySelectorAll("time[data-ago]")) {
    const text = ago(secondsSince(node.getAttribute("datetime")));
    if (node.textContent !== text) node.textContent = text;
  }
}

export function keepRelativeTimesGrowing() {
  const main = document.querySelector("main[data-server-now]");
  if (main) setServerNow(main.dataset.serverNow);
  refreshRelative();
  setInterval(refreshRelative, 5000);
}

// An element with text only: data never becomes markup.
export function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

// <time datetime=ISO title="absolute" data-ago>relative</time>
export function timeAgo(iso) {
  if (!iso) return document.createTextNode("never");
  const node = element("time", ago(secondsSince(iso)));
  node.setAttribute("datetime", iso);
  node.dataset.ago = "";
  node.title = datetime(iso);
  return node;
}
