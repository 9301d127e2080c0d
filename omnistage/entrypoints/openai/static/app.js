// The playground's entry module: reads GET /v1/capabilities (asking for the API key when it answers
// 401), then shows one tab per task the served model offers, and nothing else.

import { AuthError, apiKey, getJSON, setApiKey } from "./api.js";
import { mountChat } from "./chat.js";
import { mountImages } from "./images.js";
import { mountSpeech } from "./speech.js";
import { mountVideos } from "./videos.js";
import { el } from "./ui.js";

// tab id -> [label, is it offered, mount]
const PANELS = {
  chat: ["Chat", (c) => c.tasks.includes("chat"), mountChat],
  speech: ["Speech", (c) => c.tasks.includes("speech"), mountSpeech],
  images: ["Images", (c) => c.images !== null, mountImages],
  video: ["Video", (c) => c.tasks.includes("video"), mountVideos],
};

const $ = (id) => document.getElementById(id);

function askForKey(message) {
  const dialog = $("key-dialog");
  $("key-message").textContent = message || "";
  $("key-input").value = apiKey();
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
}

function show(caps) {
  $("model").textContent = caps.model;
  $("tasks").textContent = caps.tasks.join(" · ");
  const tabs = $("tabs");
  const main = $("panels");
  tabs.replaceChildren();
  main.replaceChildren();
  const offered = Object.entries(PANELS).filter(([, [, offers]]) => offers(caps));
  for (const [id, [label, , mount]] of offered) {
    const panel = el("section", { id: `panel-${id}`, class: "panel", hidden: true });
    mount(panel, caps);
    main.append(panel);
    tabs.append(el("button", { type: "button", id: `tab-${id}`, role: "tab", dataset: { panel: id },
      onclick: () => select(id) }, label));
  }
  if (!offered.length) main.append(el("p", {}, "This model offers no task the playground knows."));
  else select(offered[0][0]);
}

function select(id) {
  for (const tab of $("tabs").children) tab.setAttribute("aria-selected", String(tab.dataset.panel === id));
  for (const panel of $("panels").children) panel.hidden = panel.id !== `panel-${id}`;
}

async function start() {
  $("status").textContent = "loading…";
  try {
    const caps = await getJSON("/v1/capabilities");
    $("status").textContent = "";
    show(caps);
  } catch (e) {
    if (e instanceof AuthError) {
      $("status").textContent = "this server needs an API key";
      askForKey(apiKey() ? "That key was refused." : "");
    } else {
      $("status").textContent = `cannot read the server's capabilities: ${e.message}`;
    }
  }
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  setApiKey($("key-input").value.trim());
  $("key-dialog").close();
  start();
});
$("key-button").addEventListener("click", () => askForKey(""));
document.addEventListener("omnistage:auth", (e) => askForKey(`The server refused the key: ${e.detail}`));
start();
