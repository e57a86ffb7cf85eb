// ref_tokenize.cjs: the reference ids for the tokenizer tests, from the Hugging
// Face JavaScript tokenizer (@huggingface/tokenizers, pinned by setup.sh).
//
//   node ref_tokenize.cjs NODE_PREFIX tokenizer.json corpus.bin corpus.idx MODE out.ids
//
// corpus.idx is text: one "offset length" line per document of corpus.bin.
// MODE "special": HF encode (added tokens in the text become their ids);
// MODE "ordinary": the same tokenizer with added_tokens removed, i.e. every
// byte is text (what twain encodes without --allow-special).
// out.ids: for each document, uint32 count then count uint32 ids (little endian).
// With CORPUS "-" it reads JSON strings, one per stdin line, and prints id arrays.
'use strict';
const fs = require('fs');
const path = require('path');
const { createRequire } = require('module');

const [prefix, tokPath, corpusPath, idxPath, mode, outPath] = process.argv.slice(2);
const req = createRequire(path.resolve(prefix) + '/node_modules/');
const { Tokenizer } = req('@huggingface/tokenizers');
const json = JSON.parse(fs.readFileSync(tokPath, 'utf8'));
if (mode === 'ordinary') json.added_tokens = [];
else if (mode !== 'special') throw new Error('mode must be special or ordinary');
const tok = new Tokenizer(json, {});
const enc = (s) => tok.encode(s, { add_special_tokens: false }).ids;

if (corpusPath === '-') {
  const lines = fs.readFileSync(0, 'utf8').split('\n').filter((l) => l.length);
  for (const l of lines) console.log(JSON.stringify(enc(JSON.parse(l))));
  process.exit(0);
}
const corpus = fs.readFileSync(corpusPath);
const idx = fs.readFileSync(idxPath, 'utf8').trim().split('\n').map((l) => l.split(' ').map(Number));
const chunks = [];
let total = 0;
for (const [off, len] of idx) {
  const ids = enc(corpus.subarray(off, off + len).toString('utf8'));
  const b = Buffer.alloc(4 + 4 * ids.length);
  b.writeUInt32LE(ids.length, 0);
  for (let i = 0; i < ids.length; i++) b.writeUInt32LE(ids[i], 4 + 4 * i);
  chunks.push(b);
  total += ids.length;
}
fs.writeFileSync(outPath + '.tmp', Buffer.concat(chunks));
fs.renameSync(outPath + '.tmp', outPath);
console.log(`ref_tokenize: ${idx.length} documents, ${corpus.length} bytes, ${total} ids (${mode})`);
