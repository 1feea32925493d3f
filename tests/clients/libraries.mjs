// LangChain JS and the OpenAI Agents SDK against a Responses server, as a user writes them:
// `node libraries.mjs LIBRARY MODE BASE_URL`, LIBRARY "langchain" (ChatOpenAI with
// useResponsesApi) or "agents" (@openai/agents), MODE "plain", "stream", "tools" or "structured".
// Prints one JSON line: the text (and the response id), the streamed deltas, the commands the tool
// ran, the structured output, and every request body the library sent.
import { HumanMessage } from "@langchain/core/messages";
import { tool as langchainTool } from "@langchain/core/tools";
import { ChatOpenAI } from "@langchain/openai";
import { Agent, OpenAIResponsesModel, run, setTracingDisabled, tool } from "@openai/agents";
import OpenAI from "openai";
import { z } from "zod";

const [library, mode, base] = process.argv.slice(2);
const sent = [];
const fetchRecording = async (url, init) => {
  if (init?.body) sent.push(JSON.parse(init.body));
  return fetch(url, init);
};
const PROMPT = "say hi";
const TASK = "the tests fail; fix the bug";
const FILE = "File a ticket for the flaky test.";
const ticket = z.object({ title: z.string(), priority: z.enum(["low", "high"]), points: z.number().int() });
const ran = [];
const execute = async ({ cmd }) => {
  ran.push(cmd);
  return `ran ${cmd}`;
};
const EXEC = { name: "exec_command", description: "Run a shell command." };

async function langchain() {
  const model = new ChatOpenAI({
    model: "any", apiKey: "unused", useResponsesApi: true,
    configuration: { baseURL: base, fetch: fetchRecording },
  });
  if (mode === "plain") {
    const message = await model.invoke(PROMPT);
    return { text: message.text, id: message.response_metadata.id };
  }
  if (mode === "stream") {
    const deltas = [];
    let whole;
    for await (const chunk of await model.stream(PROMPT)) {
      if (chunk.text) deltas.push(chunk.text);
      whole = whole === undefined ? chunk : whole.concat(chunk);
    }
    return { deltas, text: whole.text, id: whole.response_metadata.id };
  }
  if (mode === "tools") {
    // the loop LangChain's docs show: call, run each tool call, send the results back
    const exec = langchainTool(execute, { ...EXEC, schema: z.object({ cmd: z.string() }) });
    const withTools = model.bindTools([exec]);
    const messages = [new HumanMessage(TASK)];
    for (let step = 0; step < 5; step++) {
      const reply = await withTools.invoke(messages);
      messages.push(reply);
      if (!reply.tool_calls?.length) return { ran, text: reply.text, id: reply.response_metadata.id };
      for (const call of reply.tool_calls) messages.push(await exec.invoke(call));
    }
    throw new Error("no answer after 5 steps");
  }
  return { output: await model.withStructuredOutput(ticket).invoke(FILE) };
}

async function agents() {
  setTracingDisabled(true);
  const client = new OpenAI({ baseURL: base, apiKey: "unused", fetch: fetchRecording, maxRetries: 0 });
  const model = new OpenAIResponsesModel(client, "any");
  if (mode === "plain") {
    const result = await run(new Agent({ name: "plain", model }), PROMPT);
    return { text: result.finalOutput, id: result.lastResponseId };
  }
  if (mode === "stream") {
    const result = await run(new Agent({ name: "stream", model }), PROMPT, { stream: true });
    const deltas = [];
    for await (const event of result) {
      if (event.type === "raw_model_stream_event" && event.data.type === "output_text_delta") deltas.push(event.data.delta);
    }
    await result.completed;
    return { deltas, text: result.finalOutput, id: result.lastResponseId };
  }
  if (mode === "tools") {
    const exec = tool({ ...EXEC, parameters: z.object({ cmd: z.string() }), execute });
    const result = await run(new Agent({ name: "tools", model, tools: [exec] }), TASK);
    return { ran, text: result.finalOutput, id: result.lastResponseId };
  }
  const result = await run(new Agent({ name: "structured", model, outputType: ticket }), FILE);
  return { output: result.finalOutput };
}

const result = await { langchain, agents }[library]();
console.log(JSON.stringify({ ...result, sent }));
