// llama.cpp's own plain decoding of a GGUF, for benchmarks/lowbit_decode.py to put beside ddtree's
// in one run. It uses the llama.cpp build that the npm package node-llama-cpp ships prebuilt
// (CPU variants per instruction set; no compiler needed), installed outside the project:
//
//     npm install --prefix /tmp/llama-cpp node-llama-cpp@3.22.1
//
// Reads one JSON line {model, prompt: [token ids], tokens, threads} on stdin, loads the model,
// then for each line "round" on stdin decodes `tokens` greedy tokens after the prompt (the
// prompt's evaluation not timed) and prints {tokens_per_s, tokens: [ids]} as one JSON line.
import readline from "node:readline";
import {getLlama} from "node-llama-cpp";

const lines = readline.createInterface({input: process.stdin})[Symbol.asyncIterator]();
const setup = JSON.parse((await lines.next()).value);
const llama = await getLlama({gpu: false, build: "never", logLevel: "warn"});
const model = await llama.loadModel({modelPath: setup.model});
const context = await model.createContext({threads: setup.threads, contextSize: setup.prompt.length + setup.tokens + 8});
console.log(JSON.stringify({ready: true}));

for await (const line of {[Symbol.asyncIterator]: () => lines}) {
  if (line.trim() !== "round") break;
  const sequence = context.getSequence();
  const out = [];
  let first = 0;
  for await (const token of sequence.evaluate(setup.prompt, {temperature: 0})) {
    if (out.length === 0) first = performance.now();  // the prompt is evaluated: decoding starts
    out.push(token);
    if (out.length > setup.tokens) break;
  }
  const seconds = (performance.now() - first) / 1000;
  console.log(JSON.stringify({tokens_per_s: (out.length - 1) / seconds, tokens: out.slice(0, setup.tokens)}));
  sequence.dispose();
}
process.exit(0);
