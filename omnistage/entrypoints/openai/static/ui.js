// Small DOM helpers shared by the playground's panels (text is always set as text, never as HTML).

import { AuthError } from "./api.js";

// el("input", {type: "number", id: "x"}, ...children): attributes set as properties where they exist
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key in node && typeof value !== "string") node[key] = value;
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

// <label>text <input></label>
export function field(label, input, hint) {
  return el("label", { class: "field" }, el("span", {}, label), input, hint ? el("small", {}, hint) : null);
}

export function numberInput(id, { value, min, max, step, placeholder } = {}) {
  return el("input", { type: "number", id, value: value ?? "", min, max, step, placeholder });
}

export function select(id, options, value) {
  const node = el("select", { id });
  for (const option of options) {
    const [v, text] = Array.isArray(option) ? option : [option, option];
    node.append(el("option", { value: v, selected: v === value }, text));
  }
  return node;
}

export function downloadLink(url, filename, text = "Download") {
  return el("a", { href: url, download: filename, class: "download" }, text);
}

// Shows `error` in `box`; an AuthError also asks for the key again (app.js listens).
export function showError(box, error) {
  if (error instanceof AuthError) document.dispatchEvent(new CustomEvent("omnistage:auth", { detail: error.message }));
  if (error && error.name === "AbortError") {
    box.textContent = "Stopped.";
  } else {
    box.textContent = error ? String(error.message || error) : "";
  }
  box.hidden = !box.textContent;
}

// Value of a number input, or undefined when left blank.
export function numberOf(input) {
  return input.value === "" ? undefined : Number(input.value);
}

// The default of a size-like value clamped into [multiple, max] and floored to the multiple.
export function clampToMultiple(value, multiple, max) {
  const top = Math.floor(max / multiple) * multiple;
  return Math.max(multiple, Math.min(top, Math.floor(value / multiple) * multiple));
}
