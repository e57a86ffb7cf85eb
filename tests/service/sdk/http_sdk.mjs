// http_sdk.mjs URL MODEL KEY: the official OpenAI Node SDK (pinned in
// package-lock.json) against twain's HTTP API: models, chat completions
// (plain, streamed, the stream helper), responses (plain, streamed, the
// stream helper), completions (plain, streamed), tool_choice named and
// required (chat and responses, plain and streamed); greedy requests. Prints one
// JSON object with what the SDK parsed; test_http_sdk.py compares it with the
// protobuf API's answers. Any SDK error (a response or event it cannot
// parse) ends the script with exit 1.
import OpenAI from "openai";

const [baseURL, model, apiKey, question, prompt, toolQuestion, toolsJson] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, timeout: 120000, maxRetries: 0 });
const out = { sdk: JSON.parse(await import("fs").then((fs) =>
  fs.readFileSync(new URL("./node_modules/openai/package.json", import.meta.url)))).version };
const chatReq = { model, messages: [{ role: "user", content: question }], max_tokens: 96,
                  temperature: 0, reasoning_effort: "low" };
const respReq = { model, input: question, max_output_tokens: 96, temperature: 0,
                  reasoning: { effort: "low" } };

out.models = (await client.models.list()).data.map((m) => m.id);

const chat = await client.chat.completions.create(chatReq);
out.chat = { content: chat.choices[0].message.content, reasoning: chat.choices[0].message.reasoning_content ?? null,
             finish: chat.choices[0].finish_reason, usage: chat.usage };

let content = "", reasoning = "", chunks = 0, usage = null, finish = null;
const stream = await client.chat.completions.create({ ...chatReq, stream: true,
                                                      stream_options: { include_usage: true } });
for await (const chunk of stream) {
  chunks++;
  if (chunk.usage) usage = chunk.usage;
  const c = chunk.choices[0];
  if (!c) continue;
  content += c.delta.content ?? "";
  reasoning += c.delta.reasoning_content ?? "";
  finish = c.finish_reason ?? finish;
}
out.chat_stream = { content, reasoning, chunks, usage, finish };
const helper = await client.chat.completions.stream(chatReq).finalChatCompletion();
out.chat_helper = { content: helper.choices[0].message.content };

const resp = await client.responses.create(respReq);
const rtext = (r) => r.output.filter((o) => o.type === "reasoning")
  .map((o) => (o.content ?? []).map((p) => p.text).join("")).join("");
out.responses = { text: resp.output_text, reasoning: rtext(resp), status: resp.status, usage: resp.usage };

const types = [];
let text = "", rs = "", completed = null;
for await (const ev of await client.responses.create({ ...respReq, stream: true })) {
  types.push(ev.type);
  if (ev.type === "response.output_text.delta") text += ev.delta;
  if (ev.type === "response.reasoning_text.delta") rs += ev.delta;
  if (ev.type === "response.completed" || ev.type === "response.incomplete") completed = ev.response;
}
out.responses_stream = { text, reasoning: rs, types, final_text: completed ? completed.output_text ?? null : null,
                         usage: completed ? completed.usage : null };
// the helper rebuilds the response from the events (its own output_text is
// not set by this SDK version): the message items' output_text parts
const rhelper = await client.responses.stream(respReq).finalResponse();
out.responses_helper = { text: rhelper.output.filter((o) => o.type === "message")
  .map((o) => o.content.filter((p) => p.type === "output_text").map((p) => p.text).join("")).join(""),
                         reasoning: rtext(rhelper) };

const cmpl = await client.completions.create({ model, prompt, max_tokens: 16, temperature: 0 });
out.completions = { text: cmpl.choices[0].text, finish: cmpl.choices[0].finish_reason, usage: cmpl.usage };
let ctext = "";
for await (const c of await client.completions.create({ model, prompt, max_tokens: 16, temperature: 0, stream: true }))
  ctext += c.choices[0]?.text ?? "";
out.completions_stream = { text: ctext };
// tool_choice enforced: a named function and "required" (two tools), in
// chat completions (plain, streamed by hand, the stream helper that
// accumulates tool-call deltas) and responses (plain, the stream helper)
const tools = JSON.parse(toolsJson);
const respTools = tools.map((t) => ({ type: "function", ...t.function }));
const calls = (m) => (m.tool_calls ?? []).map((c) => ({ id: c.id, type: c.type, name: c.function.name,
                                                       arguments: c.function.arguments }));
const fcalls = (r) => r.output.filter((o) => o.type === "function_call")
  .map((o) => ({ id: o.call_id, type: o.type, name: o.name, arguments: o.arguments }));
out.tools = {};
for (const [label, chatChoice, respChoice] of [
  ["named", { type: "function", function: { name: "get_time" } }, { type: "function", name: "get_time" }],
  ["required", "required", "required"]]) {
  const req = { model, messages: [{ role: "user", content: toolQuestion }], tools, tool_choice: chatChoice,
                max_tokens: 96, temperature: 0 };
  const plain = await client.chat.completions.create(req);
  const t = out.tools[label] = { chat: { calls: calls(plain.choices[0].message), finish: plain.choices[0].finish_reason,
                                         content: plain.choices[0].message.content } };
  const acc = {};
  let sfinish = null;
  for await (const chunk of await client.chat.completions.create({ ...req, stream: true })) {
    const c = chunk.choices[0];
    if (!c) continue;
    sfinish = c.finish_reason ?? sfinish;
    for (const d of c.delta.tool_calls ?? []) {
      const a = acc[d.index] ??= { id: null, type: null, name: null, arguments: "" };
      a.id = d.id ?? a.id;
      a.type = d.type ?? a.type;
      a.name = d.function?.name ?? a.name;
      a.arguments += d.function?.arguments ?? "";
    }
  }
  t.chat_stream = { calls: Object.values(acc), finish: sfinish };
  const h = await client.chat.completions.stream(req).finalChatCompletion();
  t.chat_helper = { calls: calls(h.choices[0].message), finish: h.choices[0].finish_reason };
  const rreq = { model, input: toolQuestion, tools: respTools, tool_choice: respChoice, max_output_tokens: 96,
                 temperature: 0 };
  t.responses = { calls: fcalls(await client.responses.create(rreq)) };
  t.responses_helper = { calls: fcalls(await client.responses.stream(rreq).finalResponse()) };
}
process.stdout.write(JSON.stringify(out) + "\n");
