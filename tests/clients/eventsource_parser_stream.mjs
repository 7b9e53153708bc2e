// Streams chat completions with fetch + eventsource-parser, several at once, and prints one
// JSON document: per stream the text, finish_reason, usage, event count, the comments the
// parser reported (kept apart from the data) and error (if any).
//   node eventsource_parser_stream.mjs BASE_URL STREAMS MAX_TOKENS PROMPT
import { createParser } from "eventsource-parser";

const [baseURL, streams, maxTokens, prompt] = process.argv.slice(2);

async function one() {
  const out = { text: "", finish_reason: null, completion_tokens: null, chunks: 0, comments: [],
                done: false, error: null };
  try {
    const res = await fetch(`${baseURL}/v1/chat/completions`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        messages: [{ role: "user", content: prompt }],
        max_tokens: Number(maxTokens),
        temperature: 0,
        stream: true,
        stream_options: { include_usage: true },
        ignore_eos: true,
      }),
    });
    if (!res.ok) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
    const parser = createParser({
      onEvent(event) {
        if (event.data === "[DONE]") { out.done = true; return; }
        const chunk = JSON.parse(event.data);
        if (chunk.error) throw new Error(`error event: ${event.data}`);
        out.chunks += 1;
        for (const choice of chunk.choices ?? []) {
          if (typeof choice.delta?.content === "string") out.text += choice.delta.content;
          if (choice.finish_reason) out.finish_reason = choice.finish_reason;
        }
        if (chunk.usage) out.completion_tokens = chunk.usage.completion_tokens;
      },
      onComment(comment) { out.comments.push(comment); },
      onError(err) { throw err; },
    });
    const decoder = new TextDecoder();
    for await (const bytes of res.body) parser.feed(decoder.decode(bytes, { stream: true }));
    parser.feed(decoder.decode());
  } catch (err) {
    out.error = String(err?.stack ?? err);
  }
  return out;
}

const results = await Promise.all(Array.from({ length: Number(streams) }, one));
process.stdout.write(JSON.stringify(results) + "\n");
