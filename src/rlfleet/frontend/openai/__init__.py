"""The OpenAI API (completions, chat completions, nvext), divided as vLLM divides its
OpenAI entrypoints: `routes` (the HTTP handlers) and `render` (the responses and stream
chunks, in vLLM's shapes). The request and response bodies are rlfleet.protocol.openai."""
