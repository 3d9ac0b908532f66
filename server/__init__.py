"""The websocket server (protocol decode.v1) in front of the Engine API, its health and metrics routes,
systemd integration and the latency probe. Nothing here imports torch: the server sees requests and
events (`appliance.api`) only.

protocol   decode.v1 without I/O: parsing, limits, seq, event and error frames
gate       before the upgrade: paths, bearer auth, origins
session    one connection and the one-user box
app        the asyncio process: routes, load, readiness, SIGTERM
metrics    decode_* Prometheus metrics;  gpu: NVML gauges
notify     sd_notify, load watch, watchdog;  service: the systemd unit and env file
probe/     the latency probe: client (one user over decode.v1), stats (summaries, SLOs, files), plot
"""
