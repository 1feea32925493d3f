// The Vercel AI SDK against a Responses server: `node vercel_ai.mjs BASE_URL MODE`.
// MODE "structured": Output.object with a zod schema; "multiturn": a tool loop, then a second
// turn built from the first one's messages (store: true, so earlier replies go as item_reference).
// Prints one JSON line: what the SDK returned, and the request bodies it sent.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, Output, stepCountIs, tool } from "ai";
import { z } from "zod";

const [base, mode] = process.argv.slice(2);
const sent = [];
const openai = createOpenAI({
  baseURL: base,
  apiKey: "unused",
  fetch: async (url, init) => {
    if (init?.body) sent.push(JSON.parse(init.body));
    return fetch(url, init);
  },
});
const model = openai.responses("test-model");

if (mode === "structured") {
  const ticket = z.object({ title: z.string(), priority: z.enum(["low", "high"]), points: z.number().int() });
  const result = await generateText({ model, prompt: "File a ticket for the flaky test.", output: Output.object({ schema: ticket }) });
  console.log(JSON.stringify({ output: result.output, sent }));
} else {
  const tools = {
    exec_command: tool({
      description: "Run a shell command.",
      inputSchema: z.object({ cmd: z.string() }),
      execute: async ({ cmd }) => `ran ${cmd}`,
    }),
  };
  const first = await generateText({ model, tools, stopWhen: stepCountIs(5), prompt: "the tests fail; fix the bug" });
  const messages = [{ role: "user", content: "the tests fail; fix the bug" }, ...first.response.messages, { role: "user", content: "and the other one" }];
  const second = await generateText({ model, tools, stopWhen: stepCountIs(5), messages });
  console.log(JSON.stringify({ first: first.text, firstId: first.response.id, steps: first.steps.length, second: second.text, secondId: second.response.id, sent }));
}
