// The images panel: generation (POST /v1/images/generations, JSON) or edits (POST /v1/images/edits,
// multipart with the input image), both with stream=true: a progress bar follows the per-step
// events, and each finished image appears with a download link. Sizes, steps and n are bounded by
// the model's limits from /v1/capabilities.

import { readSSE, request, streamError } from "./api.js";
import { clampToMultiple, downloadLink, el, field, numberInput, numberOf, select, showError } from "./ui.js";

// Inputs for the size / steps / guidance / seed fields every diffusion panel shares (video too).
export function diffusionInputs(prefix, lim, { autoSize = false } = {}) {
  const m = lim.size_multiple;
  const side = (value, multiple, max) => clampToMultiple(value, multiple, max);
  let w = side(lim.default_width, m.width, lim.max_width);
  let h = side(lim.default_height, m.height, lim.max_height);
  while (w * h > lim.max_pixels && (w > m.width || h > m.height)) {
    if (w >= h && w > m.width) w -= m.width;
    else h -= m.height;
  }
  const inputs = {
    width: numberInput(`${prefix}-width`, { value: autoSize ? "" : w, min: m.width, max: lim.max_width, step: m.width,
      placeholder: autoSize ? "auto" : "" }),
    height: numberInput(`${prefix}-height`, { value: autoSize ? "" : h, min: m.height, max: lim.max_height,
      step: m.height, placeholder: autoSize ? "auto" : "" }),
    steps: numberInput(`${prefix}-steps`, { value: lim.steps.default, min: 1, max: lim.steps.max }),
    guidance: numberInput(`${prefix}-guidance`, { value: lim.default_guidance_scale ?? "", min: 0, max: 100, step: 0.5,
      placeholder: "model default" }),
    seed: numberInput(`${prefix}-seed`, { placeholder: "random" }),
    negative: el("input", { id: `${prefix}-negative`, placeholder: "optional" }),
  };
  inputs.fields = [
    field("Width", inputs.width, `multiple of ${m.width}, ≤ ${lim.max_width}`),
    field("Height", inputs.height, `multiple of ${m.height}, ≤ ${lim.max_height}`),
    field("Steps", inputs.steps, `default ${lim.steps.default}`),
    field("Guidance", inputs.guidance),
    field("Seed", inputs.seed),
    field("Negative prompt", inputs.negative),
  ];
  return inputs;
}

// The request fields of those inputs (blank ones left out: the model's defaults).
export function diffusionFields(inputs) {
  const out = {};
  const w = numberOf(inputs.width);
  const h = numberOf(inputs.height);
  if (w !== undefined && h !== undefined) out.size = `${w}x${h}`;
  for (const [key, input] of [["num_inference_steps", inputs.steps], ["guidance_scale", inputs.guidance],
    ["seed", inputs.seed]]) {
    const v = numberOf(input);
    if (v !== undefined) out[key] = v;
  }
  if (inputs.negative.value.trim()) out.negative_prompt = inputs.negative.value;
  return out;
}

export function mountImages(root, caps) {
  const lim = caps.images;
  const edit = lim.edit;
  const prompt = el("textarea", { id: "image-prompt", rows: 2,
    placeholder: edit ? "What to change" : "Describe the image" });
  const inputs = diffusionInputs("image", lim, { autoSize: edit });
  const n = numberInput("image-n", { value: 1, min: 1, max: lim.max_n });
  const format = select("image-format", lim.output_formats, "png");
  const source = edit
    ? el("input", { type: "file", id: "image-source", accept: "image/*", multiple: lim.max_upload_files > 1 })
    : null;
  const go = el("button", { id: "image-go", type: "submit" }, edit ? "Edit" : "Generate");
  const progress = el("progress", { id: "image-progress", max: 1, value: 0, hidden: true });
  const status = el("span", { id: "image-status", class: "status" });
  const error = el("p", { class: "error", hidden: true });
  const results = el("div", { id: "image-results", class: "results gallery" });

  async function submit(event) {
    event.preventDefault();
    if (!prompt.value.trim()) return;
    showError(error, null);
    const fields = { model: caps.model, prompt: prompt.value, n: numberOf(n), output_format: format.value,
      stream: true, ...diffusionFields(inputs) };
    let options;
    if (edit) {
      if (!source.files.length) {
        showError(error, new Error("Choose an input image first."));
        return;
      }
      const form = new FormData();
      for (const [key, value] of Object.entries(fields)) if (value !== undefined) form.append(key, String(value));
      for (const file of source.files) form.append("image", file);
      options = { method: "POST", form };
    } else {
      options = { method: "POST", json: fields };
    }
    go.disabled = true;
    progress.hidden = false;
    progress.value = 0;
    status.textContent = "queued";
    const started = performance.now();
    try {
      const response = await request(edit ? "/v1/images/edits" : "/v1/images/generations", options);
      await readSSE(response, ({ data }) => {
        const payload = JSON.parse(data);
        const failed = streamError(payload);
        if (failed) throw failed;
        if (payload.type.endsWith(".progress")) {
          progress.value = payload.progress;
          status.textContent = `step ${payload.step} / ${payload.num_inference_steps}`;
        } else if (payload.type.endsWith(".completed")) {
          const url = `data:image/${payload.output_format};base64,${payload.b64_json}`;
          const secs = ((performance.now() - started) / 1000).toFixed(1);
          results.prepend(el("figure", {},
            el("img", { src: url, alt: prompt.value, class: "generated", title: prompt.value }),
            el("figcaption", {}, `${payload.size} · ${secs} s `,
              downloadLink(url, `image-${payload.index}.${payload.output_format}`))));
          status.textContent = "done";
        }
      });
    } catch (e) {
      showError(error, e);
      status.textContent = "";
    } finally {
      go.disabled = false;
      progress.hidden = true;
    }
  }

  root.append(el("form", { id: "image-form", onsubmit: submit }, prompt,
    source ? field("Input image", source) : null,
    el("div", { class: "grid" }, ...inputs.fields, field("Images", n), field("Format", format)),
    el("div", { class: "row" }, go, progress, status), error), results);
}
