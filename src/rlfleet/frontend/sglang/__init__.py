"""SGLang's native server API, divided as the OpenAI API is (rlfleet.frontend.openai):
`routes` (the HTTP handlers) and `render` (the bodies, in SGLang's shapes). The request and
response bodies are rlfleet.protocol.sglang."""
