// The chat panel: POST /v1/chat/completions with stream=true; text deltas are appended as they
// arrive, and with "speak the answer" (pipelines that make audio) the delta.audio chunks are played
// as they stream, then kept as a WAV clip under the answer. Media parts the model reads (caps.chat
// .input_media) can be attached as base64 data URLs.

import { base64ToBytes, fileToDataURL, readSSE, request, streamError } from "./api.js";
import { StreamPlayer } from "./audio.js";
import { downloadLink, el, field, numberInput, numberOf, select, showError } from "./ui.js";

const ACCEPT = { image: "image/*", audio: "audio/*", video: "video/*" };
const PART = { image: "image_url", audio: "audio_url", video: "video_url" };

export function mountChat(root, caps) {
  const history = [];                        // {role, content} of the conversation so far
  const log = el("div", { id: "chat-log", class: "log", "aria-live": "polite" });
  const input = el("textarea", { id: "chat-input", rows: 3, placeholder: "Say something…" });
  const system = el("input", { id: "chat-system", placeholder: "optional system prompt" });
  const maxTokens = numberInput("chat-max-tokens", { value: 256, min: 1, max: caps.chat.max_model_len || undefined });
  const temperature = numberInput("chat-temperature", { value: 0.7, min: 0, max: 2, step: 0.1 });
  const error = el("p", { class: "error", hidden: true });
  const send = el("button", { id: "chat-send", type: "submit" }, "Send");
  const stop = el("button", { id: "chat-stop", type: "button", disabled: true }, "Stop");
  const clear = el("button", { type: "button", onclick: () => { history.length = 0; log.replaceChildren(); } },
    "New chat");
  const media = caps.chat.input_media || [];
  const attach = media.length
    ? el("input", { type: "file", id: "chat-attach", multiple: true, accept: media.map((m) => ACCEPT[m]).join(",") })
    : null;
  const audio = caps.tasks.includes("chat_audio");
  const speak = audio ? el("input", { type: "checkbox", id: "chat-speak" }) : null;
  const voice = audio ? select("chat-voice", caps.audio.voices.map((v) => [v.id, v.name || v.id])) : null;
  let controller = null;

  async function parts(text) {
    if (!attach || !attach.files.length) return text;
    const out = [{ type: "text", text }];
    for (const file of attach.files) {
      const kind = media.find((m) => file.type.startsWith(m + "/"));
      if (!kind) throw new Error(`${file.name}: this model reads ${media.join(", ")} only`);
      out.push({ type: PART[kind], [PART[kind]]: { url: await fileToDataURL(file) } });
    }
    attach.value = "";
    return out;
  }

  async function submit(event) {
    event.preventDefault();
    const text = input.value.trim();
    if (!text || controller) return;
    showError(error, null);
    const user = { role: "user", content: await parts(text).catch((e) => { showError(error, e); return null; }) };
    if (user.content === null) return;
    history.push(user);
    log.append(el("div", { class: "msg user" }, text));
    const answer = el("div", { class: "msg assistant" });
    const body = el("span", { class: "text" });
    answer.append(body);
    log.append(answer);
    input.value = "";
    const messages = system.value.trim() ? [{ role: "system", content: system.value.trim() }, ...history] : history;
    const payload = { model: caps.model, messages, stream: true, max_tokens: numberOf(maxTokens),
      temperature: numberOf(temperature) };
    const player = speak && speak.checked ? new StreamPlayer("wav") : null;
    if (player) {
      payload.modalities = ["text", "audio"];
      payload.audio = { voice: voice.value, format: "wav" };
    }
    controller = new AbortController();
    send.disabled = true;
    stop.disabled = false;
    answer.classList.add("streaming");
    try {
      const response = await request("/v1/chat/completions",
        { method: "POST", json: payload, signal: controller.signal });
      await readSSE(response, ({ data }) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        const failed = streamError(chunk);
        if (failed) throw failed;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          if (delta.content) body.textContent += delta.content;
          if (delta.audio && delta.audio.data && player) {
            player.push(base64ToBytes(delta.audio.data));
            answer.dataset.audioPieces = player.pieces.length;   // pieces scheduled for playback so far
          }
          if (choice.finish_reason) answer.dataset.finish = choice.finish_reason;
        }
        log.scrollTop = log.scrollHeight;
      });
      history.push({ role: "assistant", content: body.textContent });
    } catch (e) {
      showError(error, e);
      history.pop();
    } finally {
      answer.classList.remove("streaming");
      controller = null;
      send.disabled = false;
      stop.disabled = true;
      if (player && player.samples) {
        const url = URL.createObjectURL(player.blob());
        answer.append(el("audio", { controls: true, src: url, class: "clip" }), downloadLink(url, "answer.wav"));
      }
    }
  }

  stop.addEventListener("click", () => controller && controller.abort());
  const form = el("form", { id: "chat-form", onsubmit: submit },
    input,
    el("div", { class: "row" }, send, stop, clear, attach ? field("Attach", attach) : null),
    el("details", {}, el("summary", {}, "Settings"),
      el("div", { class: "grid" }, field("System prompt", system), field("Max tokens", maxTokens),
        field("Temperature", temperature),
        speak ? field("Speak the answer", speak) : null, voice ? field("Voice", voice) : null)),
    error);
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      form.requestSubmit();
    }
  });
  root.append(log, form);
}
