// The video panel: jobs of POST /v1/videos (JSON, or multipart with the input image of an
// image-to-video model), listed from GET /v1/videos and polled while any is unfinished (status and
// progress); a completed one can be played and downloaded (GET /v1/videos/{id}/content, fetched with
// the key), and any can be deleted.

import { getJSON, request } from "./api.js";
import { diffusionFields, diffusionInputs } from "./images.js";
import { downloadLink, el, field, numberInput, numberOf, showError } from "./ui.js";

const POLL_MS = 1000;

export function mountVideos(root, caps) {
  const lim = caps.video;
  const prompt = el("textarea", { id: "video-prompt", rows: 2, placeholder: "Describe the clip" });
  const inputs = diffusionInputs("video", lim);
  const step = lim.frame_step || 1;
  const maxFrames = lim.max_num_frames;
  const frames = numberInput("video-frames", { value: Math.min(lim.default_num_frames || maxFrames, maxFrames),
    min: 1, max: maxFrames, step });
  const fps = numberInput("video-fps", { value: lim.default_fps || "", min: 1, max: lim.max_fps });
  const reference = lim.input_reference === "required"
    ? el("input", { type: "file", id: "video-reference", accept: "image/*" }) : null;
  const go = el("button", { id: "video-go", type: "submit" }, "Create job");
  const error = el("p", { class: "error", hidden: true });
  const list = el("div", { id: "video-jobs", class: "results" });
  const players = el("div", { id: "video-players", class: "results" });
  let timer = null;

  async function refresh() {
    clearTimeout(timer);
    try {
      const page = await getJSON("/v1/videos?limit=100");
      list.replaceChildren(...page.data.map(row));
      const running = page.data.some((j) => j.status === "queued" || j.status === "in_progress");
      if (running) timer = setTimeout(refresh, POLL_MS);
    } catch (e) {
      showError(error, e);
    }
  }

  async function content(job) {
    const response = await request(`/v1/videos/${job.id}/content`);
    return URL.createObjectURL(await response.blob());
  }

  function row(job) {
    const done = job.status === "completed";
    const actions = el("span", { class: "row" });
    if (done) {
      actions.append(el("button", { type: "button", class: "play", onclick: async () => {
        try {
          const url = await content(job);
          const video = el("video", { controls: true, autoplay: true, loop: true, src: url });
          players.prepend(el("figure", { dataset: { id: job.id } }, video,
            el("figcaption", {}, `${job.prompt.slice(0, 60)} `, downloadLink(url, `${job.id}.mp4`))));
        } catch (e) { showError(error, e); }
      } }, "Play"), el("button", { type: "button", class: "save", onclick: async () => {
        try {
          const a = downloadLink(await content(job), `${job.id}.mp4`);
          document.body.append(a);
          a.click();
          a.remove();
        } catch (e) { showError(error, e); }
      } }, "Download"));
    }
    actions.append(el("button", { type: "button", class: "delete", onclick: async () => {
      try {
        await request(`/v1/videos/${job.id}`, { method: "DELETE" });
        await refresh();
      } catch (e) { showError(error, e); }
    } }, "Delete"));
    const failed = job.error ? ` — ${job.error.message}` : "";
    return el("div", { class: `job ${job.status}`, dataset: { id: job.id, status: job.status } },
      el("span", { class: "prompt" }, job.prompt.slice(0, 80)),
      el("span", { class: "meta" }, `${job.size} · ${job.num_frames} frames @ ${job.fps} fps`),
      el("progress", { max: 100, value: job.progress }),
      el("span", { class: "status" }, `${job.status} ${job.progress}%${failed}`), actions);
  }

  async function submit(event) {
    event.preventDefault();
    if (!prompt.value.trim()) return;
    showError(error, null);
    const fields = { model: caps.model, prompt: prompt.value, num_frames: numberOf(frames), fps: numberOf(fps),
      ...diffusionFields(inputs) };
    let options = { method: "POST", json: fields };
    if (reference) {
      if (!reference.files.length) {
        showError(error, new Error("Choose the input image first."));
        return;
      }
      const form = new FormData();
      for (const [key, value] of Object.entries(fields)) if (value !== undefined) form.append(key, String(value));
      form.append("input_reference", reference.files[0]);
      options = { method: "POST", form };
    }
    go.disabled = true;
    try {
      await request("/v1/videos", options);
      await refresh();
    } catch (e) {
      showError(error, e);
    } finally {
      go.disabled = false;
    }
  }

  root.append(el("form", { id: "video-form", onsubmit: submit }, prompt,
    reference ? field("Input image", reference) : null,
    el("div", { class: "grid" }, ...inputs.fields,
      field("Frames", frames, `k × ${step} + 1, ≤ ${maxFrames}`), field("FPS", fps)),
    el("div", { class: "row" }, go), error),
  el("h3", {}, "Jobs"), list, players);
  refresh();
}
