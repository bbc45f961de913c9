"""vLLM's own serving routes beside its OpenAI API (/inference/v1/generate, /tokenize,
/detokenize, the render routes), divided as the OpenAI API is (rlfleet.frontend.openai):
`routes` (the HTTP handlers) and `render` (the bodies, in vLLM's shapes). The request and
response bodies are rlfleet.protocol.vllm_native."""
