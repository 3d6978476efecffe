// Number and time formatting shared by the pages (what the server renders first).

export function integer(value) {
  return Number(value).toLocaleString("en-US");
}

export function fixed(value, digits) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}

export function minutes(seconds) {
  return `${(seconds / 60).toFixed(1)} min`;
}

export function clock(iso) {
  if (!iso) return "never";
  return `${new Date(iso).toISOString().slice(11, 19)} UTC`;
}

export function eta(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds === 0) return "reached";
  if (seconds < 120) return `${Math.ceil(seconds)} s`;
  return minutes(seconds);
}

// An element with text only: data never becomes markup.
export function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}
