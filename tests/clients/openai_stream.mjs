// Streams chat completions with the openai Node SDK, several at once, and prints one JSON
// document: per stream the text, finish_reason, usage, chunk count and error (if any).
//   node openai_stream.mjs BASE_URL STREAMS MAX_TOKENS PROMPT
import OpenAI from "openai";

const [baseURL, streams, maxTokens, prompt] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: "unused", maxRetries: 0, timeout: 600_000 });

async function one() {
  const out = { text: "", finish_reason: null, completion_tokens: null, chunks: 0, error: null };
  try {
    const stream = await client.chat.completions.create({
      model: "served",
      messages: [{ role: "user", content: prompt }],
      max_tokens: Number(maxTokens),
      temperature: 0,
      stream: true,
      stream_options: { include_usage: true },
      ignore_eos: true, // llama-server's extension: exactly max_tokens tokens
    });
    for await (const chunk of stream) {
      out.chunks += 1;
      for (const choice of chunk.choices ?? []) {
        if (typeof choice.delta?.content === "string") out.text += choice.delta.content;
        if (choice.finish_reason) out.finish_reason = choice.finish_reason;
      }
      if (chunk.usage) out.completion_tokens = chunk.usage.completion_tokens;
    }
  } catch (err) {
    out.error = String(err?.stack ?? err);
  }
  return out;
}

const results = await Promise.all(Array.from({ length: Number(streams) }, one));
process.stdout.write(JSON.stringify(results) + "\n");
