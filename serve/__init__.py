"""The Ray Serve application (`serve.app.build_app`): its validated config, the OpenAI-compatible
ingress (chat and completions, SSE streaming, API keys, limits, admission), the engine deployment
(one replica = one model instance running the step loop), its Prometheus metrics, and what
`ddtree serve` does around Ray's start and stop (`launch`)."""
