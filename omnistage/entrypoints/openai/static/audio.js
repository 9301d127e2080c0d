// Audio played while it streams: the bytes of a WAV stream (44-byte header, then 16-bit PCM) or of
// raw 16-bit mono PCM at a known rate arrive piece by piece; each piece is scheduled on a Web Audio
// clock right after the previous one. At the end the whole clip becomes a WAV blob for an <audio>.

const WAV_HEADER = 44;
const LEAD_S = 0.08;                         // first piece starts this long after it arrives

export class StreamPlayer {
  // format: "wav" (rate read from the header) or "pcm" (rate given); play: false = collect only
  constructor(format, sampleRate = 24000, play = true) {
    this.format = format;
    this.rate = sampleRate;
    this.play = play;
    this.header = format === "wav" ? new Uint8Array(0) : null;   // bytes of the WAV header still being read
    this.carry = null;                       // odd trailing byte of the last piece
    this.pieces = [];                        // Int16Array pieces received so far
    this.ctx = null;
    this.next = 0;                           // Web Audio time at which the next piece starts
  }

  push(bytes) {
    if (this.header !== null) {
      const need = WAV_HEADER - this.header.length;
      const head = new Uint8Array(this.header.length + Math.min(need, bytes.length));
      head.set(this.header);
      head.set(bytes.subarray(0, need), this.header.length);
      this.header = head;
      bytes = bytes.subarray(need);
      if (this.header.length < WAV_HEADER) return;
      this.rate = new DataView(this.header.buffer).getUint32(24, true);
      this.header = null;
    }
    if (this.carry !== null) {
      const joined = new Uint8Array(bytes.length + 1);
      joined[0] = this.carry;
      joined.set(bytes, 1);
      bytes = joined;
      this.carry = null;
    }
    if (bytes.length % 2) {
      this.carry = bytes[bytes.length - 1];
      bytes = bytes.subarray(0, bytes.length - 1);
    }
    if (!bytes.length) return;
    const samples = new Int16Array(bytes.slice().buffer);
    this.pieces.push(samples);
    if (this.play) this.schedule(samples);
  }

  schedule(samples) {
    if (!this.ctx) {
      this.ctx = new AudioContext();
      this.next = this.ctx.currentTime + LEAD_S;
    }
    const buffer = this.ctx.createBuffer(1, samples.length, this.rate);
    const channel = buffer.getChannelData(0);
    for (let i = 0; i < samples.length; i++) channel[i] = samples[i] / 32768;
    const source = this.ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(this.ctx.destination);
    this.next = Math.max(this.next, this.ctx.currentTime + 0.01);
    source.start(this.next);
    this.next += samples.length / this.rate;
  }

  get samples() {
    return this.pieces.reduce((n, p) => n + p.length, 0);
  }

  stop() {
    if (this.ctx) this.ctx.close();
    this.ctx = null;
  }

  // The clip so far as a WAV file.
  blob() {
    const n = this.samples;
    const out = new DataView(new ArrayBuffer(WAV_HEADER + 2 * n));
    const text = (at, s) => [...s].forEach((c, i) => out.setUint8(at + i, c.charCodeAt(0)));
    text(0, "RIFF");
    out.setUint32(4, 36 + 2 * n, true);
    text(8, "WAVEfmt ");
    out.setUint32(16, 16, true);
    out.setUint16(20, 1, true);              // PCM
    out.setUint16(22, 1, true);              // mono
    out.setUint32(24, this.rate, true);
    out.setUint32(28, this.rate * 2, true);
    out.setUint16(32, 2, true);
    out.setUint16(34, 16, true);
    text(36, "data");
    out.setUint32(40, 2 * n, true);
    let at = WAV_HEADER;
    for (const piece of this.pieces) {
      for (let i = 0; i < piece.length; i++, at += 2) out.setInt16(at, piece[i], true);
    }
    return new Blob([out.buffer], { type: "audio/wav" });
  }
}
