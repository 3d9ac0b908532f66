"""The decode wing: the request loop (a request in, Engine API events out), the device-side decode session
it drives, the cycle steps over static buffers that graphs/ captures, and the speculator. Imports the model
wing, graphs and kernels; never the parallel wing (ranks reach it as the loaded model's `world`)."""
