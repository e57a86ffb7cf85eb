// bench_reference_node.cjs: single-thread encode MB/s of Hugging Face tokenizers
// (the Rust library through its node binding, npm "tokenizers") and tiktoken
// (the Rust core compiled to WebAssembly, npm "tiktoken"), given the same
// ranks, on the corpus of gen_corpus.py: the comparison points for
// twain-bench-tokenizer on a machine without the Python packages. On the GPU
// machine use bench_reference.py (native Python wheels) instead.
//
//   npm install --prefix DIR tokenizers@0.23.2 tiktoken@1.0.22
//   RAYON_NUM_THREADS=1 node bench_reference_node.cjs DIR TOKENIZER_JSON DATA_DIR [REPEATS]
//
// tiktoken gets the ranks of tokenizer.json (vocab id = rank, spec §5.1) and
// the pre-tokenizer regex of spec §5.2 from the same file. Both tokenizers'
// ids are also compared with DATA_DIR/real.{special,ordinary}.ids (setup.sh).
'use strict';
const fs = require('fs');
const path = require('path');
const { createRequire } = require('module');

// CPU seconds of this process since c0 (all threads: the HF binding encodes on a
// libuv worker while the main thread waits). On a loaded machine wall time also
// counts waiting for a core.
function cpuSince(c0) {
  const d = process.cpuUsage(c0);
  return (d.user + d.system) / 1e6;
}

async function main() {
  const [prefix, tokPath, dataDir, repArg] = process.argv.slice(2);
  const repeats = Number(repArg || 3);
  const req = createRequire(path.resolve(prefix) + '/node_modules/');
  const corpus = fs.readFileSync(path.join(dataDir, 'corpus.bin'));
  const idx = fs.readFileSync(path.join(dataDir, 'corpus.idx'), 'utf8').trim().split('\n')
    .map((l) => l.split(' ').map(Number));
  const docs = idx.map(([off, len]) => corpus.subarray(off, off + len).toString('utf8'));
  const kinds = fs.readFileSync(path.join(dataDir, 'corpus.idx'), 'utf8').trim().split('\n')
    .map((l) => l.split(' ')[2]);
  // one timed pass per kind of text (the breakdown twain-bench-tokenizer prints too)
  const perKind = async (name, enc) => {
    const t = new Map();
    for (let i = 0; i < docs.length; i++) {
      const c0 = process.cpuUsage();
      await enc(docs[i]);
      const s = cpuSince(c0);
      const e = t.get(kinds[i]) || [0, 0];
      t.set(kinds[i], [e[0] + idx[i][1], e[1] + s]);
    }
    for (const [k, [b, s]] of t)
      console.log(`  ${name} ${k.padEnd(12)} ${String(b).padStart(9)} bytes ${(b / s / 1e6).toFixed(2).padStart(8)} MB/s cpu`);
  };
  const readRef = (name) => {
    const p = path.join(dataDir, name);
    if (!fs.existsSync(p)) return null;
    const b = fs.readFileSync(p);
    const out = [];
    for (let o = 0; o < b.length;) {
      const n = b.readUInt32LE(o);
      out.push(Array.from({ length: n }, (_, i) => b.readUInt32LE(o + 4 + 4 * i)));
      o += 4 + 4 * n;
    }
    return out;
  };
  const refSpecial = readRef('real.special.ids');
  const refOrdinary = readRef('real.ordinary.ids');
  const mb = corpus.length / 1e6;
  console.log(`corpus: ${docs.length} documents, ${corpus.length} bytes; best of ${repeats}`);

  // Hugging Face tokenizers (Rust, node binding)
  const { Tokenizer } = req('tokenizers');
  const hf = Tokenizer.fromFile(tokPath);
  let best = 1e30, bestCpu = 1e30, ids = [];
  for (let r = 0; r < repeats; r++) {
    ids = [];
    const t0 = process.hrtime.bigint(), c0 = process.cpuUsage();
    for (const d of docs) ids.push((await hf.encode(d, null, { addSpecialTokens: false })).getIds());
    const s = Number(process.hrtime.bigint() - t0) / 1e9, c = cpuSince(c0);
    if (s < best) best = s;
    if (c < bestCpu) bestCpu = c;
  }
  let mism = refSpecial ? ids.filter((x, i) => x.join() !== refSpecial[i].join()).length : -1;
  console.log(`hf tokenizers (rust, node binding): ${(mb / best).toFixed(2)} MB/s wall, ` +
              `${(mb / bestCpu).toFixed(2)} MB/s cpu` +
              (mism >= 0 ? `; documents differing from the reference ids: ${mism}` : ''));
  await perKind('hf', (d) => hf.encode(d, null, { addSpecialTokens: false }));

  // tiktoken (Rust core as WebAssembly) with the ranks of tokenizer.json
  const json = JSON.parse(fs.readFileSync(tokPath, 'utf8'));
  const bs = [];
  for (let b = 0; b < 256; b++)
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174) bs.push(b);
  const inv = new Map();
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (bs.includes(b)) inv.set(String.fromCodePoint(b), b);
    else inv.set(String.fromCodePoint(256 + n++), b);
  }
  const lines = [];
  for (const [k, id] of Object.entries(json.model.vocab)) {
    const bytes = Buffer.from(Array.from(k, (c) => inv.get(c)));
    lines.push(`${bytes.toString('base64')} ${id}`);
  }
  const split = json.pre_tokenizer.pretokenizers.find((p) => p.type === 'Split');
  const { Tiktoken } = req('tiktoken/lite');
  const tt = new Tiktoken(lines.join('\n'), {}, split.pattern.Regex);
  best = 1e30;
  bestCpu = 1e30;
  for (let r = 0; r < repeats; r++) {
    ids = [];
    const t0 = process.hrtime.bigint(), c0 = process.cpuUsage();
    for (const d of docs) ids.push(tt.encode_ordinary(d));
    const s = Number(process.hrtime.bigint() - t0) / 1e9, c = cpuSince(c0);
    if (s < best) best = s;
    if (c < bestCpu) bestCpu = c;
  }
  mism = refOrdinary ? ids.filter((x, i) => Array.from(x).join() !== refOrdinary[i].join()).length
                     : -1;
  console.log(`tiktoken (rust as wasm): ${(mb / best).toFixed(2)} MB/s wall, ` +
              `${(mb / bestCpu).toFixed(2)} MB/s cpu` +
              (mism >= 0 ? `; documents differing from the reference ids: ${mism}` : ''));
  await perKind('tiktoken', (d) => tt.encode_ordinary(d));
  tt.free();
}

main().catch((e) => { console.error(e); process.exit(1); });
