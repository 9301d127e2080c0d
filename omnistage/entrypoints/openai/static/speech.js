// The speech panel: POST /v1/audio/speech with a voice, format and speed. WAV and PCM can stream
// (stream_format "audio": the bytes are played as they arrive); every answer ends as a clip with
// a download link.

import { request } from "./api.js";
import { StreamPlayer } from "./audio.js";
import { downloadLink, el, field, numberInput, numberOf, select, showError } from "./ui.js";

const STREAMABLE = ["wav", "pcm"];           // formats whose bytes can be played before the end

export function mountSpeech(root, caps) {
  const voices = caps.audio.voices;
  const text = el("textarea", { id: "speech-input", rows: 4, maxLength: caps.speech.max_input_chars,
    placeholder: "Text to speak" });
  const label = (v) => `${v.name || v.id}${v.language ? ` (${v.language})` : ""}`;
  const voice = select("speech-voice", voices.map((v) => [v.id, label(v)]));
  const format = select("speech-format", caps.speech.formats, "wav");
  const { min, max } = caps.speech.speed;
  const speed = numberInput("speech-speed", { value: 1, min, max, step: 0.05 });
  const stream = el("input", { type: "checkbox", id: "speech-stream",
    checked: caps.speech.stream_formats.includes("audio") });
  const go = el("button", { id: "speech-go", type: "submit" }, "Speak");
  const error = el("p", { class: "error", hidden: true });
  const out = el("div", { id: "speech-out", class: "results" });

  function streamable() {
    return stream.checked && STREAMABLE.includes(format.value);
  }
  format.addEventListener("change", () => { stream.disabled = !STREAMABLE.includes(format.value); });

  async function submit(event) {
    event.preventDefault();
    if (!text.value.trim()) return;
    showError(error, null);
    go.disabled = true;
    const fmt = format.value;
    const payload = { model: caps.model, input: text.value, voice: voice.value, response_format: fmt,
      speed: numberOf(speed) };
    try {
      let url;
      if (streamable()) {
        payload.stream_format = "audio";
        const rate = (voices.find((v) => v.id === voice.value) || {}).sample_rate;
        const player = new StreamPlayer(fmt, rate);
        const response = await request("/v1/audio/speech", { method: "POST", json: payload });
        const reader = response.body.getReader();
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          player.push(value);
        }
        url = URL.createObjectURL(player.blob());
      } else {
        const response = await request("/v1/audio/speech", { method: "POST", json: payload });
        url = URL.createObjectURL(await response.blob());
      }
      const playable = fmt !== "pcm" || streamable();   // a .pcm file is bytes without a header
      out.prepend(el("div", { class: "clip-row" },
        el("span", {}, `${voice.value}: ${text.value.slice(0, 60)}`),
        playable ? el("audio", { controls: true, src: url, class: "clip" }) : null,
        downloadLink(url, `speech.${streamable() ? "wav" : fmt}`)));
    } catch (e) {
      showError(error, e);
    } finally {
      go.disabled = false;
    }
  }

  root.append(el("form", { id: "speech-form", onsubmit: submit }, text,
    el("div", { class: "grid" }, field("Voice", voice), field("Format", format), field("Speed", speed),
      field("Play while it streams", stream)),
    el("div", { class: "row" }, go), error), out);
}
