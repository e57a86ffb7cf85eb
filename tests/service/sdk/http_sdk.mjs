// http_sdk.mjs URL MODEL KEY: the official OpenAI Node SDK (pinned in
// package-lock.json) against twain's HTTP API: models, chat completions
// (plain, streamed, the stream helper), responses (plain, streamed, the
// stream helper), completions (plain, streamed); greedy requests. Prints one
// JSON object with what the SDK parsed; test_http_sdk.py compares it with the
// protobuf API's answers. Any SDK error (a response or event it cannot
// parse) ends the script with exit 1.
import OpenAI from "openai";

const [baseURL, model, apiKey, question, prompt] = process.argv.slice(2);
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
process.stdout.write(JSON.stringify(out) + "\n");
