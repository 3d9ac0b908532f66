"""The serving front, on one port (aiohttp): the websocket server (protocol decode.v1), the OpenAI- and
Anthropic-compatible HTTP API, the health and metrics routes, systemd integration and the latency probe.
Nothing here imports torch: the server sees requests and events (`appliance.api`) only.

protocol       decode.v1 without I/O: parsing, limits, seq, event and error frames
gate           before a request is served: paths, methods, bearer auth, origins and CORS, content types
box            the one-user box and the running request whose pace sets Retry-After
session        one websocket connection
openai_api     OpenAI chat completions, completions, models without I/O: bodies -> requests, events -> replies
anthropic_api  Anthropic Messages and count_tokens without I/O, likewise
responses_api  OpenAI Responses without I/O: input items -> a chat request, events -> typed stream events
fields         reading an API body's fields (400 naming the parameter)
http_api       one API call: origin, auth, body, the box (queue / 429), JSON or SSE with keep-alives, send
               deadline, cancel on disconnect
incidents      what clients do to the server (over the cap, slow bodies, slow readers), a log line an incident
strict_json    the one JSON policy (orjson reads what it writes)
app            the asyncio process: routes, the capped listener, load, readiness, SIGTERM
metrics        decode_* Prometheus metrics;  gpu: NVML gauges
notify         sd_notify, load watch, watchdog;  service: the systemd unit and env file
probe/         the latency probe: client (one user over decode.v1 or OpenAI's streaming chat), stats, plot
"""
