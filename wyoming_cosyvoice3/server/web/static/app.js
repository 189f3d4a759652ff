// The voice page: lists the server's voices, adds / edits / deletes them and plays previews.
// Every URL is relative, so the page also works behind Home Assistant's ingress path.
"use strict";

const MAX_RECORD_S = 30;            // the model uses at most 30 s of a reference clip
const CHANGE_HEADERS = { "X-Voice-Page": "1" };  // required by the server for changes

const $ = (id) => document.getElementById(id);
let voices = [];
let editing = null;          // name of the voice being edited, or null when adding
let recorded = null;         // WAV Blob of a browser recording
let recorder = null;
let shown = "";               // the last listing rendered (JSON text)

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props);
  for (const child of children) node.append(child);
  return node;
}

function showMessage(id, text, kind) {
  const node = $(id);
  node.textContent = text;
  node.className = "message" + (kind ? " " + kind : "");
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error) return body.error;
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

function voiceUrl(name, tail = "") {
  return "api/voices/" + encodeURIComponent(name) + tail;
}

// --- the list -------------------------------------------------------------------------------

async function refresh() {
  let data;
  try {
    const response = await fetch("api/voices", { cache: "no-store" });
    if (!response.ok) throw new Error(await errorText(response));
    data = await response.json();
  } catch (err) {
    $("status").textContent = "The server does not answer: " + err.message;
    return;
  }
  const seen = JSON.stringify(data);
  if (seen === shown) return;  // unchanged: keep the table (and the user's focus) as it is
  shown = seen;
  voices = data.voices;
  const installed = voices.filter((v) => v.installed).length;
  const states = { ready: "model ready", loading: "model loading (" + data.phase + ")",
                   failed: "model unavailable: " + data.error };
  $("status").textContent = `${states[data.state] || data.state} · ${installed} of ` +
    `${voices.length} voices installed`;
  if (data.catalog) $("catalog-path").textContent = data.catalog;
  renderPreset(data.preset);
  renderTable(data);
  renderPreviewChoices();
}

// The preset requests run with; with --preset auto, what the machine measurement predicted.
function renderPreset(preset) {
  const node = $("preset");
  if (!preset) { node.hidden = true; return; }
  node.hidden = false;
  if (preset.choice) {
    const rtf = preset.choice.predicted_rtf;
    const rows = Object.keys(rtf).map((name) => `${name} ${rtf[name].toFixed(2)}`).join(", ");
    node.textContent = `Preset ${preset.choice.preset} (chosen for this machine): ` +
      preset.choice.summary.replace(/^preset auto took `[a-z]+`: /, "") +
      `. Predicted real-time factor (seconds of work per second of speech): ${rows}.`;
  } else if (preset.auto) {
    node.textContent = "Preset: chosen for this machine when the model loads.";
  } else {
    node.textContent = `Preset ${preset.name} (set in the options).`;
  }
}

function renderTable(data) {
  const body = $("voices").tBodies[0];
  body.replaceChildren();
  for (const voice of voices) {
    const name = el("td", {}, el("b", { textContent: voice.name }));
    if (voice.description && voice.description !== voice.name) {
      name.append(el("span", { className: "desc", textContent: voice.description }));
    }
    if (voice.name === data.default_voice) {
      name.append(el("span", { className: "desc", textContent: "default voice" }));
    }
    let state;
    if (voice.installed) {
      state = el("td", { className: "state-installed", textContent: "installed" });
    } else if (voice.problem) {
      state = el("td", { className: "state-disabled", textContent: "disabled" },
                 el("span", { className: "problem", textContent: voice.problem }));
    } else {
      state = el("td", { textContent: data.state === "ready" ? "not installed" : "waiting for the model" });
    }
    const actions = el("td", { className: "actions" });
    if (voice.clip_s !== null) {
      actions.append(el("button", { type: "button", className: "secondary", textContent: "Clip",
        title: "Listen to the reference clip", onclick: () => playClip(voice.name) }));
    }
    if (voice.installed) {
      actions.append(el("button", { type: "button", className: "secondary", textContent: "Try",
        title: "Choose this voice for the preview", onclick: () => choosePreview(voice.name) }));
    }
    if (voice.editable) {
      actions.append(el("button", { type: "button", className: "secondary", textContent: "Edit",
        onclick: () => startEdit(voice) }));
      actions.append(el("button", { type: "button", className: "danger", textContent: "Delete",
        onclick: () => deleteVoice(voice.name) }));
    } else {
      actions.append(el("span", { className: "desc", textContent: voice.source === "built-in" ?
        "built-in" : "from " + voice.source }));
    }
    const row = el("tr", {}, name,
      el("td", { textContent: voice.languages.join(", ") }),
      el("td", { textContent: voice.mode }),
      el("td", { className: "nowrap",
                 textContent: voice.clip_s === null ? "–" : voice.clip_s.toFixed(1) + " s" }),
      state, actions);
    row.dataset.voice = voice.name;
    body.append(row);
  }
}

function renderPreviewChoices() {
  const select = $("preview-voice");
  const chosen = select.value;
  select.replaceChildren();
  for (const voice of voices.filter((v) => v.installed)) {
    select.append(el("option", { value: voice.name, textContent: voice.name }));
  }
  if (voices.some((v) => v.installed && v.name === chosen)) select.value = chosen;
  $("preview-button").disabled = select.options.length === 0;
}

function choosePreview(name) {
  $("preview-voice").value = name;
  $("preview-text").focus();
}

function playClip(name) {
  const audio = $("preview-audio");
  audio.src = voiceUrl(name, "/clip");
  audio.play().catch(() => {});
}

// --- preview --------------------------------------------------------------------------------

async function preview(event) {
  event.preventDefault();
  const name = $("preview-voice").value;
  const text = $("preview-text").value.trim();
  if (!name || !text) return;
  const url = voiceUrl(name, "/preview?text=" + encodeURIComponent(text));
  const audio = $("preview-audio");
  showMessage("preview-message", "Speaking…");
  audio.onerror = async () => {
    // the element hides the server's message: ask again for it (errors come before audio)
    const response = await fetch(url, { cache: "no-store" });
    showMessage("preview-message", response.ok ? "The browser cannot play the audio."
      : await errorText(response), "error");
  };
  audio.onplaying = () => showMessage("preview-message", `Playing ${name}…`);
  audio.onended = () => showMessage("preview-message", "");
  audio.src = url;
  audio.play().catch(() => {});
}

// --- add / edit / delete --------------------------------------------------------------------

function startEdit(voice) {
  editing = voice.name;
  const form = $("voice-form");
  form.reset();
  clearRecording();
  $("f-name").value = voice.name;
  $("f-name").readOnly = true;
  $("f-description").value = voice.description === voice.name ? "" : voice.description;
  $("f-languages").value = voice.languages.join(", ");
  $("f-transcript").value = voice.transcript || "";
  $("f-instruction").value = voice.instruction || "";
  $("editor-title").textContent = "Edit " + voice.name;
  $("save").textContent = "Save changes";
  $("cancel-edit").hidden = false;
  showMessage("form-message", "Leave the clip empty to keep the current one.");
  form.scrollIntoView({ behavior: "smooth" });
}

function stopEdit() {
  editing = null;
  $("voice-form").reset();
  clearRecording();
  $("f-name").readOnly = false;
  $("editor-title").textContent = "Add a voice";
  $("save").textContent = "Add voice";
  $("cancel-edit").hidden = true;
}

async function saveVoice(event) {
  event.preventDefault();
  const form = $("voice-form");
  const data = new FormData(form);
  const file = $("f-clip").files[0];
  if (!file && recorded) data.set("clip", recorded, "recording.wav");
  if (!file && !recorded) {
    data.delete("clip");
    if (!editing) {
      showMessage("form-message", "Choose an audio file or record a clip.", "error");
      return;
    }
  }
  $("save").disabled = true;
  showMessage("form-message", "Checking the clip and preparing the voice…");
  try {
    const response = await fetch(editing ? voiceUrl(editing) : "api/voices", {
      method: editing ? "PUT" : "POST", body: data, headers: CHANGE_HEADERS });
    if (!response.ok) {
      showMessage("form-message", await errorText(response), "error");
      return;
    }
    const voice = await response.json();
    stopEdit();
    showMessage("form-message", `Saved ${voice.name} (${voice.mode}). It can be used now; ` +
      "reload the Wyoming integration in Home Assistant to see it there.", "ok");
    await refresh();
    if (voice.installed) choosePreview(voice.name);
  } catch (err) {
    showMessage("form-message", "The server does not answer: " + err.message, "error");
  } finally {
    $("save").disabled = false;
  }
}

async function deleteVoice(name) {
  if (!window.confirm(`Delete the voice ${name}? Its clip is deleted too.`)) return;
  const response = await fetch(voiceUrl(name), { method: "DELETE", headers: CHANGE_HEADERS });
  if (!response.ok) {
    showMessage("form-message", await errorText(response), "error");
    return;
  }
  if (editing === name) stopEdit();
  showMessage("form-message", `Deleted ${name}. Reload the Wyoming integration in Home ` +
    "Assistant to drop it there.", "ok");
  await refresh();
}

// --- recording in the browser ---------------------------------------------------------------

function clearRecording() {
  recorded = null;
  $("clip-audio").hidden = true;
  $("clip-audio").removeAttribute("src");
  $("record-state").textContent = "";
}

function encodeWav(buffer) {
  // mono 16-bit PCM WAV at the buffer's own rate (the server resamples)
  const channels = buffer.numberOfChannels;
  const length = buffer.length;
  const mono = new Float32Array(length);
  for (let c = 0; c < channels; c++) {
    const data = buffer.getChannelData(c);
    for (let i = 0; i < length; i++) mono[i] += data[i] / channels;
  }
  const view = new DataView(new ArrayBuffer(44 + 2 * length));
  const text = (offset, s) => { for (let i = 0; i < s.length; i++) view.setUint8(offset + i, s.charCodeAt(i)); };
  text(0, "RIFF"); view.setUint32(4, 36 + 2 * length, true); text(8, "WAVE");
  text(12, "fmt "); view.setUint32(16, 16, true); view.setUint16(20, 1, true);
  view.setUint16(22, 1, true); view.setUint32(24, buffer.sampleRate, true);
  view.setUint32(28, 2 * buffer.sampleRate, true); view.setUint16(32, 2, true);
  view.setUint16(34, 16, true); text(36, "data"); view.setUint32(40, 2 * length, true);
  for (let i = 0; i < length; i++) {
    const s = Math.max(-1, Math.min(1, mono[i]));
    view.setInt16(44 + 2 * i, s < 0 ? s * 0x8000 : s * 0x7fff, true);
  }
  return new Blob([view], { type: "audio/wav" });
}

async function toggleRecording() {
  const button = $("record");
  if (recorder) {
    recorder.stop();
    return;
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (err) {
    $("record-state").textContent = "No microphone: " + err.message;
    return;
  }
  const chunks = [];
  recorder = new MediaRecorder(stream);
  recorder.ondataavailable = (e) => { if (e.data.size) chunks.push(e.data); };
  const started = Date.now();
  const timer = setInterval(() => {
    const seconds = (Date.now() - started) / 1000;
    $("record-state").textContent = `recording ${seconds.toFixed(0)} s (stops at ${MAX_RECORD_S} s)`;
    if (seconds >= MAX_RECORD_S && recorder) recorder.stop();
  }, 250);
  recorder.onstop = async () => {
    clearInterval(timer);
    stream.getTracks().forEach((t) => t.stop());
    recorder = null;
    button.classList.remove("recording");
    button.textContent = "● Record";
    try {
      const context = new AudioContext();
      const decoded = await context.decodeAudioData(await new Blob(chunks).arrayBuffer());
      await context.close();
      recorded = encodeWav(decoded);
      $("f-clip").value = "";
      $("clip-audio").src = URL.createObjectURL(recorded);
      $("clip-audio").hidden = false;
      $("record-state").textContent = `recorded ${decoded.duration.toFixed(1)} s`;
    } catch (err) {
      $("record-state").textContent = "The recording cannot be read: " + err.message;
    }
  };
  recorder.start();
  button.classList.add("recording");
  button.textContent = "■ Stop";
}

// --- start ----------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("preview-form").addEventListener("submit", preview);
  $("voice-form").addEventListener("submit", saveVoice);
  $("cancel-edit").addEventListener("click", () => { stopEdit(); showMessage("form-message", ""); });
  $("f-clip").addEventListener("change", () => { if ($("f-clip").files.length) clearRecording(); });
  if (navigator.mediaDevices && window.MediaRecorder) {
    $("record").addEventListener("click", toggleRecording);
  } else {
    $("record").disabled = true;
    $("record-state").textContent = "recording needs https:// or localhost; upload a file instead";
  }
  refresh();
  setInterval(() => { if (!document.hidden) refresh(); }, 10000);
});
